"""Per-rank agent: hooks PyTorch training and reports to the node's exporter.

from syncscope.agent import attach
agent = attach(model=ddp_model, optimizer=optimizer)   # exporter from $SYNCSCOPE_EXPORTER
"""

from syncscope.agent.config import AgentConfig
from syncscope.agent.core import Agent, RankAgent, attach

__all__ = ["Agent", "AgentConfig", "RankAgent", "attach"]
