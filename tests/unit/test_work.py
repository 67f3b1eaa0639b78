"""Work done per step (samples, tokens): read from the model's inputs where they say it, set
through attach() / agent.count() / the integrations, carried to the exporter over HTTP and the
shared-memory ring, and exported per rank only where known."""

from __future__ import annotations

import json
import os
import struct
from collections import deque
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from fastapi.testclient import TestClient  # noqa: E402
from syncscope.agent import attach  # noqa: E402
from syncscope.agent.shm_ring import ShmRing  # noqa: E402
from syncscope.exporter.app import create_app, parse_batch  # noqa: E402
from syncscope.exporter.settings import Settings  # noqa: E402
from syncscope.exporter.shm_reader import BadRing, RingReader  # noqa: E402
from syncscope.exporter.store import Store  # noqa: E402

from syncscope.shm_layout import (  # noqa: E402
    HEAD,
    HEADER_BYTES,
    KIND_STEP,
    MAGIC,
    META_OFFSET,
    SLOT_BYTES,
    STEP_SLOT_V1,
    VERSION,
    WRITE_SEQ_AT,
)
from tests.conftest import by_rank, parse_samples, step_rows  # noqa: E402

UNKNOWN = (-1, -1)


class Tagger(torch.nn.Module):
    """A token model: ids (batch, seq) -> one logit per sequence."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(50, 4)
        self.head = torch.nn.Linear(4, 1)

    def forward(self, input_ids=None, pixel_values=None, labels=None):
        if input_ids is None:
            return self.head(pixel_values.flatten(1)[:, :4])
        return self.head(self.emb(input_ids).mean(1))


class Scale(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(()))

    def forward(self, x):
        return x * self.w


class DictModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(3, 1)

    def forward(self, batch):
        return self.lin(batch["x"] if isinstance(batch, dict) else batch)


@pytest.fixture
def agents(monkeypatch):
    """`agents(model, **config)`: an agent and its SGD optimizer. One agent a process: the next
    call closes the one before, so read an agent's rows before making the next."""
    monkeypatch.delenv("SYNCSCOPE_EXPORTER", raising=False)
    made: list = []

    def make(model, **config):
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        agent = attach(model=model, optimizer=opt, exporter=None, flush_interval_s=3600, **config)
        made.append(agent)
        return agent, opt

    yield make
    for agent in made:
        agent.close()


def work(agent) -> list[tuple[int, int]]:
    return [tuple(row[9:]) for row in step_rows(agent)]


def step(opt, *losses) -> None:
    for loss in losses:
        loss.sum().backward()
    opt.step()
    opt.zero_grad()


# -- read from the model's inputs ----------------------------------------------------------------
def test_the_leading_dimension_is_the_batch_and_token_ids_give_tokens(agents):
    lin = torch.nn.Linear(6, 1)
    agent, opt = agents(lin)
    step(opt, lin(torch.randn(5, 6)))  # float features: samples only
    step(opt, lin(torch.randn(7, 3, 6)))  # a float (batch, seq, features) input: still not tokens
    assert work(agent) == [(5, -1), (7, -1)] and agent.errors == 0
    tagger = Tagger()
    agent2, opt2 = agents(tagger)
    step(opt2, tagger(torch.randint(0, 50, (4, 12))))  # positional token ids
    step(opt2, tagger(input_ids=torch.randint(0, 50, (3, 9), dtype=torch.int32)))  # keyword
    assert work(agent2) == [(4, 48), (3, 27)]
    assert agent2.errors == 0


def test_micro_batches_add_up_and_evaluation_without_gradients_does_not_count(agents):
    tagger = Tagger()
    agent, opt = agents(tagger)
    for sizes in ((4, 4, 2), (8,)):  # gradient accumulation: three micro-batches, then one
        losses = [tagger(torch.randint(0, 50, (n, 10))) for n in sizes]
        with torch.no_grad():  # an evaluation inside the loop is no training work
            tagger(torch.randint(0, 50, (64, 10)))
        with torch.inference_mode():
            tagger(torch.randint(0, 50, (64, 10)))
        step(opt, *losses)
    assert work(agent) == [(10, 100), (8, 80)]


def test_inputs_that_do_not_say_give_no_number(agents):
    model = DictModel()
    agent, opt = agents(model)
    step(opt, model({"x": torch.randn(4, 3)}))  # a dict: which entry is the batch?
    step(opt, model(torch.randn(4, 3)), model({"x": torch.randn(4, 3)}))  # one clear, one not
    step(opt, model(torch.randn(4, 3)))
    assert work(agent) == [UNKNOWN, UNKNOWN, (4, -1)]
    scale = Scale()
    agent2, opt2 = agents(scale)
    step(opt2, scale(torch.tensor(2.0)))  # a scalar: no batch dimension
    opt2.step()  # a step with no forward at all
    assert work(agent2) == [UNKNOWN, UNKNOWN]


def test_the_batch_argument_names_the_keyword_holding_the_batch(agents):
    tagger = Tagger()
    agent, opt = agents(tagger, batch_argument="pixel_values")
    step(opt, tagger(pixel_values=torch.randn(6, 3, 2, 2), labels=torch.zeros(6)))
    assert work(agent) == [(6, -1)]
    other = Tagger()
    agent2, opt2 = agents(other)  # the default keyword, input_ids, is not among these
    step(opt2, other(pixel_values=torch.randn(6, 3, 2, 2)))
    assert work(agent2) == [UNKNOWN]


# -- set by the user ------------------------------------------------------------------------------
def test_a_count_in_the_step_wins_over_settings_and_inputs(agents):
    tagger = Tagger()
    agent, opt = agents(tagger, samples_per_step=32)
    step(opt, tagger(torch.randint(0, 50, (4, 10))))  # setting: 32 samples; tokens still read
    agent.count(samples=3)
    agent.count(samples=2, tokens=7)  # calls in one step add up
    agent.count(samples=-5, tokens=None)  # ignored
    step(opt, tagger(torch.randint(0, 50, (4, 10))))
    step(opt, tagger(torch.randint(0, 50, (4, 10))))  # the count was that step's only
    assert work(agent) == [(32, 40), (5, 7), (32, 40)]


def test_an_absurd_count_is_capped_where_the_exporter_would_refuse_the_batch(agents):
    from syncscope.wire import MAX_WORK

    lin = torch.nn.Linear(6, 1)
    agent, opt = agents(lin)
    agent.count(tokens=MAX_WORK)
    agent.count(tokens=1)
    step(opt, lin(torch.randn(5, 6)))
    assert work(agent) == [(5, MAX_WORK)]
    ingest = parse_batch(json.dumps(batch(0, [list(step_rows(agent)[0])])).encode())
    assert ingest.steps[0][4:] == (5, MAX_WORK)


def test_without_detection_only_what_is_set_counts(agents):
    lin = torch.nn.Linear(6, 1)
    agent, opt = agents(lin, detect_work=False, tokens_per_step=1000)
    step(opt, lin(torch.randn(5, 6)))
    assert agent.clock.work.inputs is None
    assert work(agent) == [(-1, 1000)]
    both, _ = agents(torch.nn.Linear(6, 1), samples_per_step=8, tokens_per_step=64)
    assert both.clock.work.inputs is None  # both set: nothing read on the training thread
    with both.step():
        pass
    assert work(both) == [(8, 64)]


def test_steps_marked_by_hand_count_inside_the_block_only(monkeypatch):
    monkeypatch.delenv("SYNCSCOPE_EXPORTER", raising=False)
    lin = torch.nn.Linear(2, 1)
    agent = attach(model=lin, exporter=None, flush_interval_s=3600)
    try:
        lin(torch.randn(9, 2)).sum().backward()  # before the first marked step: no step's
        for n in (3, 4):
            with agent.step():
                lin(torch.randn(n, 2)).sum().backward()
        with agent.step():
            agent.count(samples=11, tokens=12)
        assert work(agent) == [(3, -1), (4, -1), (11, 12)]
    finally:
        agent.close()


def test_a_failure_reading_inputs_never_reaches_the_training_loop(agents):
    lin = torch.nn.Linear(6, 1)
    agent, opt = agents(lin)

    def broken() -> bool:
        raise RuntimeError("grad mode unreadable")

    tensor, dtypes, keyword, _ = agent.clock.work.inputs
    agent.clock.work.inputs = (tensor, dtypes, keyword, broken)
    out = lin(torch.randn(5, 6))  # the forward still runs and returns
    step(opt, out)
    assert out.shape == (5, 1) and agent.errors == 1
    assert len(agent.queues.steps) == 1


def test_the_record_file_has_the_work_where_known(monkeypatch, tmp_path):
    monkeypatch.delenv("SYNCSCOPE_EXPORTER", raising=False)
    lin = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)
    agent = attach(model=lin, optimizer=opt, exporter=None, record=str(tmp_path / "r.jsonl"))
    try:
        step(opt, lin(torch.randn(3, 2)))
        step(opt, lin(torch.randn(4, 2)))
        agent.reporter.flush()
    finally:
        agent.close()
    lines = [json.loads(line) for line in (tmp_path / "r.jsonl").read_text().splitlines()]
    lines = [line for line in lines if "event" not in line]  # the startup's line
    assert [line.get("samples") for line in lines] == [3, 4]
    assert all("tokens" not in line for line in lines)
    assert all(sum(line["phases"].values()) == pytest.approx(line["step_s"]) for line in lines)


# -- to the exporter ------------------------------------------------------------------------------
def batch(rank: int, rows: list[list[int]], version: int = 2) -> dict:
    return {
        "schema_version": version,
        "agent": {
            "job": "w",
            "rank": rank,
            "local_rank": rank,
            "world_size": 3,
            "incarnation": f"i{rank}",
            "hostname": "n1",
        },  # fmt: skip
        "clock_offset_ns": 1_700_000_000 * 10**9,
        "steps": rows,
    }


def row(i: int, *work: int) -> list[int]:
    return [i, i * 10**8, 10**8, 0, 0, 0, 0, 0, 0, *work]


def test_counters_are_the_sum_of_known_steps_and_absent_where_never_known():
    with TestClient(create_app(Settings(powercap_root=None))) as client:
        rows = [row(0, 32, 4096), row(1, 32, -1), row(2, -1, -1), row(3, 16, 2048)]
        assert client.post("/v1/ingest", json=batch(0, rows)).status_code == 200
        old = [row(i) for i in range(4)]  # an agent from before work was counted: 9 fields
        assert client.post("/v1/ingest", json=batch(1, old)).status_code == 200
        unknown = [row(i, -1, -1) for i in range(4)]
        assert client.post("/v1/ingest", json=batch(2, unknown)).status_code == 200
        bad = batch(2, [row(4, -2, 0)])  # -1 is the only "not known"
        assert client.post("/v1/ingest", json=bad).status_code == 422
        v1 = {**batch(2, []), "schema_version": 1}
        v1["steps"] = [{"step": 5, "duration_s": 0.1, "end_unix_s": 1.7e9, "samples": 8}]
        assert client.post("/v1/ingest", json=v1).status_code == 200
        text = client.get("/metrics").text
        state = client.get("/v1/state").json()
    samples = parse_samples(text, "syncscope_rank_samples_total")
    tokens = parse_samples(text, "syncscope_rank_tokens_total")
    assert by_rank(samples) == {0: 80, 2: 8}
    assert by_rank(tokens) == {0: 6144}
    ranks = {r["rank"]: r for r in state["jobs"]["w"]["ranks"]}
    # 80 samples over the 3 steps (0.3 s) that said how many; tokens over their 2 steps
    assert ranks[0]["samples_per_s"] == pytest.approx(80 / 0.3)
    assert ranks[0]["tokens_per_s"] == pytest.approx(6144 / 0.2)
    assert ranks[1]["samples_total"] is None and ranks[1]["samples_per_s"] is None


def test_ring_steps_carry_their_work_and_rows_without_it_go_in_as_unknown(tmp_path: Path):
    ident = {"job": "w", "rank": 0, "local_rank": 0, "world_size": 1, "incarnation": "i",
             "hostname": "h", "pid": os.getpid(), "started_unix_s": 1.0}  # fmt: skip
    ring = ShmRing(str(tmp_path / "a.ring"), {"agent": ident}, capacity=8)
    ring.take_steps(deque([tuple(row(0, 32, 4096)), tuple(row(1, -1, 7))]))
    ring.take_steps(deque([tuple(row(2))]))  # a producer of the 9-field rows
    ring.publish()
    reader = RingReader(ring.path)
    steps, colls, _events = reader.read(10)
    assert [s[9:] for s in steps] == [(32, 4096), (-1, 7), UNKNOWN]
    store = Store(Settings())  # what the exporter's poller does with them
    store.ingest(parse_batch(json.dumps(reader.batch(steps, colls, {})).encode()))
    assert store.ranks[("w", 0)].samples_total == 32
    assert store.ranks[("w", 0)].tokens_total == 4096 + 7


def version_1_ring(path: Path, version: int = 1) -> None:
    """A ring as an agent from before work was counted wrote it: 9-field step slots."""
    meta = json.dumps({"agent": {"job": "old", "rank": 0, "local_rank": 0, "world_size": 1,
                                 "incarnation": "o", "hostname": "h"}}).encode()  # fmt: skip
    capacity = 4
    buf = bytearray(HEADER_BYTES + capacity * SLOT_BYTES)
    HEAD.pack_into(buf, 0, MAGIC, version, SLOT_BYTES, capacity, 0, 0, 0, 0, 0, len(meta), 0, 1)
    buf[META_OFFSET : META_OFFSET + len(meta)] = meta
    STEP_SLOT_V1.pack_into(buf, HEADER_BYTES, 1, KIND_STEP, *row(0), 1)
    struct.pack_into("<Q", buf, WRITE_SEQ_AT, 1)
    path.write_bytes(bytes(buf))


def test_a_version_1_ring_is_read_with_its_work_unknown_and_an_unknown_version_refused(tmp_path):
    version_1_ring(tmp_path / "old.ring")
    steps, _, _events = RingReader(str(tmp_path / "old.ring")).read(10)
    assert steps == [tuple(row(0))]  # 9 fields: no work in that layout
    assert parse_batch(json.dumps(batch(0, [list(steps[0])])).encode()).steps[0][4:] == UNKNOWN
    version_1_ring(tmp_path / "future.ring", version=VERSION + 1)
    with pytest.raises(BadRing):
        RingReader(str(tmp_path / "future.ring"))


# -- the integrations -----------------------------------------------------------------------------
def test_lightning_batches_count_where_their_tensors_agree():
    pytest.importorskip("lightning")
    from syncscope.integrations.lightning import batch_work

    ids = torch.randint(0, 9, (4, 16))
    assert batch_work((torch.randn(8, 3), torch.zeros(8))) == (8, None)
    assert batch_work({"input_ids": ids, "attention_mask": ids, "labels": ids}) == (4, 64)
    assert batch_work([ids, torch.zeros(4)]) == (4, 64)
    assert batch_work((torch.randn(8, 3), torch.zeros(5))) == (None, None)  # they disagree
    assert batch_work({"text": ["a", "b"]}) == (None, None)
    assert batch_work(torch.tensor(3.0)) == (None, None)


def test_lightning_counts_every_batch_of_a_real_fit(monkeypatch, tmp_path):
    """10 samples in batches of 4, 4 and 2, two batches per step: steps of 8 and 2 samples (the
    epoch's last batch ends its step), twice."""
    pl = pytest.importorskip("lightning.pytorch")
    from syncscope.integrations.lightning import SyncscopeCallback

    monkeypatch.delenv("SYNCSCOPE_EXPORTER", raising=False)
    seen: list = []

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(3, 1)

        def training_step(self, batch, _idx):
            x, y = batch
            return torch.nn.functional.mse_loss(self.lin(x).squeeze(1), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    class Keep(SyncscopeCallback):
        def on_fit_end(self, trainer, pl_module):
            seen.extend(work(self.agent))
            super().on_fit_end(trainer, pl_module)

    data = torch.utils.data.TensorDataset(torch.randn(10, 3), torch.randn(10))
    loader = torch.utils.data.DataLoader(data, batch_size=4)
    trainer = pl.Trainer(
        max_epochs=2,
        accumulate_grad_batches=2,
        callbacks=[Keep(exporter=None, flush_interval_s=3600)],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
        default_root_dir=str(tmp_path),
    )
    trainer.fit(Module(), loader)
    assert [s for s, _ in seen] == [8, 2, 8, 2]
    assert sum(s for s, _ in seen) == 2 * len(data)


def test_hugging_face_reads_the_models_main_input(monkeypatch):
    pytest.importorskip("transformers")
    from syncscope.integrations.huggingface import SyncscopeCallback

    monkeypatch.delenv("SYNCSCOPE_EXPORTER", raising=False)

    class Vision(Tagger):
        main_input_name = "pixel_values"

    for model, inputs, expected in (
        (Vision(), {"pixel_values": torch.randn(6, 3, 2, 2)}, (6, -1)),
        (Tagger(), {"input_ids": torch.randint(0, 50, (2, 5))}, (2, 10)),
    ):
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        callback = SyncscopeCallback(exporter=None, flush_interval_s=3600)
        callback.on_train_begin(None, None, None, model=model, optimizer=opt)
        try:
            step(opt, model(**inputs, labels=torch.zeros(6)))  # Trainer: keywords only
            assert work(callback.agent) == [expected]
        finally:
            callback.on_train_end(None, None, None)
