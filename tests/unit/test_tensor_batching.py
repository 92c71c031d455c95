"""How tensor requests form batches and are split back, without a server: ``core/forming.py``
never mixes groups (a tensor model's shapes past the batch dimension) and cuts a batch back
to a preferred size; ``TensorRuntime.run_batch`` (a tiny real ONNX graph) concatenates,
pads ragged inputs, cuts outputs back, splits rows in order, and fails only the request the
graph fails on."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from sokuji.core.forming import BatchPolicy, choose
from sokuji.core.request import InferenceRequest, Prepared, Priority, Timeline
from sokuji.errors import InputFailed
from sokuji.runtimes.tensor import Failed, Options, TensorRuntime
from tests import tensor_graphs as graphs


def req(items: int, group: object, at: int, priority: Priority = Priority.INTERACTIVE
        ) -> InferenceRequest:
    return InferenceRequest(model="m", payload=None, num_items=items, length=4,
                            timeline=Timeline(0), enqueued_ns=at, group=group,
                            priority=priority)


def test_other_shapes_never_share_a_batch() -> None:
    queue = [req(1, ("x", (3,)), 0), req(1, ("x", (4,)), 1), req(2, ("x", (3,)), 2),
             req(1, ("x", (4,)), 3)]
    for policy in BatchPolicy:
        first = choose(queue, policy, 16, 1 << 20, 10**9, 10)
        assert first.indices == [0, 2] and first.items == 3
        second = choose([queue[1], queue[3]], policy, 16, 1 << 20, 10**9, 10)
        assert second.indices == [0, 1]


def test_a_batch_is_cut_back_to_a_preferred_size() -> None:
    queue = [req(1, None, i) for i in range(7)]
    assert choose(queue, BatchPolicy.FIFO, 8, 1 << 20, 10**9, 10, (2, 4)).items == 4
    assert choose(queue[:3], BatchPolicy.FIFO, 8, 1 << 20, 10**9, 10, (2, 4)).items == 2
    assert choose(queue[:1], BatchPolicy.FIFO, 8, 1 << 20, 10**9, 10, (2, 4)).items == 1
    # max_batch_size first: 7 queued, at most 6 -> the preferred 4
    assert choose(queue, BatchPolicy.FIFO, 6, 1 << 20, 10**9, 10, (4, 6)).items == 6


def test_the_first_by_priority_leads_its_own_group() -> None:
    queue = [req(1, "a", 0, Priority.BATCH), req(1, "b", 1), req(1, "a", 2)]
    choice = choose(queue, BatchPolicy.FIFO, 8, 1 << 20, 10**12, 10)
    assert choice.indices == [1]  # interactive "b" first, alone: no other "b"


@pytest.fixture(scope="module")
def directory(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("graphs")


def prepared(feeds: dict[str, np.ndarray]) -> Prepared:
    first = next(iter(feeds.values()))
    return Prepared(data=feeds, num_items=int(first.shape[0]), length=1, num_tokens=0)


def test_rows_are_split_back_in_order(directory: Path) -> None:
    rt = TensorRuntime(graphs.write_arith(directory))
    rt.load()
    assert rt.batched
    rng = np.random.default_rng(0)
    parts = [{"a": rng.normal(size=(r, 5)).astype(np.float32),
              "b": rng.normal(size=(r, 5)).astype(np.float32)} for r in (1, 3, 2)]
    results = rt.run_batch([prepared(p) for p in parts])
    whole = rt.run_one({k: np.concatenate([p[k] for p in parts]) for k in ("a", "b")})
    start = 0
    for p, out in zip(parts, results, strict=True):
        assert isinstance(out, dict)
        rows = slice(start, start + len(p["a"]))
        start = rows.stop
        alone = rt.run_one(p)
        for name in ("sum", "ratio", "total"):  # exactly the same batch's rows
            np.testing.assert_array_equal(out[name], whole[name][rows])
        for name in ("sum", "ratio"):  # elementwise: the same alone
            np.testing.assert_array_equal(out[name], alone[name])
        # A reduction's order depends on the batch (ONNX Runtime's kernels): within 1 ulp
        np.testing.assert_allclose(out["total"], alone["total"], rtol=3e-7)


def test_ragged_inputs_are_padded_and_cut_outputs_cut_back(directory: Path) -> None:
    rt = TensorRuntime(graphs.write_arith(directory),
                       Options(ragged={"a": 0.0, "b": 1.0}, cut=("sum", "ratio")))
    rt.load()
    short = {"a": np.ones((1, 2), np.float32), "b": np.full((1, 2), 2.0, np.float32)}
    long = {"a": np.ones((2, 4), np.float32), "b": np.full((2, 4), 4.0, np.float32)}
    one, two = rt.run_batch([prepared(short), prepared(long)])
    assert isinstance(one, dict) and isinstance(two, dict)
    np.testing.assert_array_equal(one["sum"], [[3.0, 3.0]])  # cut back to its own 2
    np.testing.assert_array_equal(one["ratio"], [[0.5, 0.5]])
    np.testing.assert_array_equal(one["total"], [4.0])  # padding: a = 0 adds nothing
    np.testing.assert_array_equal(two["sum"], np.full((2, 4), 5.0))


def test_only_the_request_the_graph_fails_on_fails(directory: Path) -> None:
    rt = TensorRuntime(graphs.write_gather(directory))
    rt.load()
    rt.warmup()
    good, bad = np.array([[1], [2]], np.int64), np.array([[9]], np.int64)
    results = rt.run_batch([prepared({"index": good}), prepared({"index": bad}),
                            prepared({"index": good[:1]})])
    assert isinstance(results[1], Failed) and isinstance(results[1].error, InputFailed)
    assert "Gather" in str(results[1].error)
    assert isinstance(results[0], dict) and results[0]["value"].tolist() == [[10.0], [20.0]]
    assert isinstance(results[2], dict) and results[2]["value"].tolist() == [[10.0]]


def test_a_graph_without_a_batch_dimension_is_unbatched(directory: Path) -> None:
    rt = TensorRuntime(graphs.write_fixed(directory))
    rt.load()
    assert not rt.batched
    assert rt.describe().inputs[0].shape == (2, 4)
