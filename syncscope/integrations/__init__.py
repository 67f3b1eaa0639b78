"""Thin adapters that attach syncscope to a training framework through `syncscope.agent.attach`.

  syncscope.integrations.lightning    `SyncscopeCallback` for PyTorch Lightning
  syncscope.integrations.huggingface  `SyncscopeCallback` for `transformers.Trainer`
  syncscope.integrations.run          `torchrun … -m syncscope.integrations.run train.py …`:
                                      no edit to the training script at all

Each module imports without its framework; constructing a callback without the framework raises
ImportError naming the package to install. Nothing here uses more than the public agent API:
`attach()` and the `RankAgent` it returns (`agent.step()`, `agent.count()`, `agent.close()`).
"""

__all__: list[str] = []
