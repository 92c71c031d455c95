"""Kind ``python`` without a server: an entry loaded in each of its forms (``pkg.module:Class``,
``path/file.py:Class``, a function) and every bad one a ``ConfigError`` naming
``models[0].options.entry``; the kind's own options split from the class's (every other key,
and ``setup = {...}``, reach ``setup(options)``; a key given twice refused); what
``predict`` returns checked (``pycode/results.py``); values converted both ways
(``kinds/python/values.py``); the stages a model reports sanitised and bounded; the
in-thread runner calling the code as its form says, an exception's text never in what the
client gets."""

from __future__ import annotations

import inspect
import textwrap
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest

import sokuji
from sokuji import config as cfg
from sokuji.core.tensor import InferRequest, Tensor
from sokuji.errors import BadModelOutput, ConfigError, InvalidInput, ModelCodeFailed
from sokuji.kinds.python import values
from sokuji.pycode import entry as entry_
from sokuji.pycode import results, stage
from sokuji.pycode.inthread import ThreadRunner
from sokuji.pycode.runner import invoke, invoke_stream
from sokuji.repository.models import ModelRepository
from tests.conftest import CACHE_DIR, ROOT, options_of
from tests.data.pymodels import core_forms

PKG = "tests.data.pymodels"


def python(options: dict[str, Any], **config: Any) -> cfg.ModelConfig:
    return cfg.ModelConfig(name="m", runtime="python", options=options, **config)


def write(folder: Path, name: str, code: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text(textwrap.dedent(code))
    return path


# -- entries -------------------------------------------------------------------------------

def test_a_module_path_entry_loads_the_class() -> None:
    code = options_of(python({"entry": f"{PKG}.core_forms:Echo"})).code
    assert code.target is core_forms.Echo and code.mode == "sync" and not code.function
    assert not code.deterministic and not code.describes


def test_a_file_entry_loads_relative_to_the_working_directory() -> None:
    code = options_of(python({"entry": "tests/data/pymodels/iris.py:Iris"})).code
    assert code.target.__name__ == "Iris" and code.deterministic
    again = entry_.load("iris.py:Iris", "k", ROOT / "tests" / "data" / "pymodels")
    assert again.target is code.target  # one file, one module, whatever the spelling


def test_a_file_entry_imports_its_siblings_and_two_model_files_never_collide(
        tmp_path: Path) -> None:
    for folder, value in (("a", 1), ("b", 2)):
        write(tmp_path / folder, f"helper_{folder}.py", f"VALUE = {value}\n")
        write(tmp_path / folder, "model.py", f"""
            from helper_{folder} import VALUE

            class M:
                def predict(self, inputs):
                    return [{{"v": VALUE}} for _ in inputs]
            """)
    a = entry_.load(str(tmp_path / "a" / "model.py") + ":M", "k")
    b = entry_.load(str(tmp_path / "b" / "model.py") + ":M", "k")
    assert a.target is not b.target
    assert [a.new().predict([{}]), b.new().predict([{}])] == [[{"v": 1}], [{"v": 2}]]


def test_a_function_entry_is_called_per_request_with_its_values() -> None:
    code = options_of(python({"entry": f"{PKG}.core_forms:double"})).code
    assert code.function and code.mode == "sync" and not code.takes_options
    ran = invoke(code, code.new(), [{"x": np.ones(2, np.float32)},
                                    {"x": np.arange(3, dtype=np.float32)}], "m")
    assert [r["y"].tolist() for r in ran.results] == [[2.0, 2.0], [0.0, 2.0, 4.0]]


def test_a_function_calls_outcomes_are_each_its_own() -> None:
    """Mutant: one call's exception failing the whole batch (``runner._call_function``
    not catching): the good requests of the batch would fail too."""
    code = options_of(python({"entry": f"{PKG}.core_forms:halve"})).code
    ran = invoke(code, code.new(), [{"x": np.ones(2, np.float32)},
                                    {"x": -np.ones(2, np.float32)},
                                    {"x": np.full(1, 4, np.float32)}], "m")
    good, bad, other = ran.results
    assert good["y"].tolist() == [0.5, 0.5] and other["y"].tolist() == [2.0]
    assert isinstance(bad, ModelCodeFailed) and "ValueError" in str(bad)
    assert "secret" not in str(bad)


def test_a_class_may_fail_one_request_by_returning_an_exception() -> None:
    code = code_of(core_forms.PerRequest)
    ran = invoke(code, code.new(), [{"how": "ok"}, {"how": "refuse"}, {"how": "fail"}], "m")
    ok, refused, failed = ran.results
    assert ok["x"].tolist() == [0.0]
    assert isinstance(refused, InvalidInput) and refused.param == "how"
    assert isinstance(failed, ModelCodeFailed) and "secret" not in str(failed)


def test_a_generator_function_is_refused_as_an_entry(tmp_path: Path) -> None:
    path = write(tmp_path, "genfn.py", """
        def gen(x):
            yield {"y": x}
        """)
    with pytest.raises(ConfigError, match="generator function") as err:
        options_of(python({"entry": f"{path}:gen"}))
    assert "options.entry" in str(err.value)


def test_each_form_of_predict_is_read(tmp_path: Path) -> None:
    path = write(tmp_path, "forms.py", """
        import msgspec

        class In(msgspec.Struct):
            text: str

        class Out(msgspec.Struct):
            n: int

        class Gen:
            def predict(self, inputs):
                yield [None] * len(inputs)

        class AsyncGen:
            async def predict(self, inputs):
                yield [None] * len(inputs)

        class Typed:
            task = "embeddings"
            def setup(self):
                pass
            def predict(self, inputs: list[In]) -> list[Out]:
                return [Out(len(i.text)) for i in inputs]
        """)
    modes = {name: entry_.load(f"{path}:{name}", "k") for name in ("Gen", "AsyncGen", "Typed")}
    assert modes["Gen"].mode == "generator" and modes["Gen"].streams
    assert modes["AsyncGen"].mode == "async_generator"
    typed = modes["Typed"]
    assert (typed.mode, typed.task, typed.takes_options) == ("sync", "embeddings", False)
    assert typed.input_type.__name__ == "In" and typed.output_type.__name__ == "Out"
    described = entry_.load(f"{PKG}.core_forms:Described", "k")
    assert described.mode == "async" and described.describes


BAD_ENTRIES = [
    ("no-separator", "must be 'package.module:Class'"),
    ("tests/data/pymodels/iris.py:", "must be 'package.module:Class'"),
    ("tests/data/pymodels/iris.py:1x", "must be 'package.module:Class'"),
    ("tests/data/pymodels/absent.py:X", "no such file"),
    ("no_such_module_sokuji:X", "cannot be imported: ModuleNotFoundError"),
    (f"{PKG}.core_forms:Absent", "has no 'Absent'"),
    (f"{PKG}.core_forms:CALLS", "is a list, not a class or a function"),
]


@pytest.mark.parametrize(("entry", "why"), BAD_ENTRIES, ids=[e for e, _ in BAD_ENTRIES])
def test_a_bad_entry_names_options_entry(entry: str, why: str) -> None:
    with pytest.raises(ConfigError) as err:
        options_of(python({"entry": entry}))
    assert err.value.param == "models[0].options.entry"
    assert "models[0].options.entry" in str(err.value) and why in str(err.value), err.value


@pytest.mark.parametrize(("code", "why"), [
    ("raise ValueError('broken at import')\n", "cannot be imported: ValueError: broken at "
                                                "import"),
    ("import sys\nsys.exit(3)\n", "cannot be imported: SystemExit: 3"),
    ("class X:\n    pass\n", "class X has no predict method"),
    ("class X:\n    task = 'translate'\n    def predict(self, inputs):\n        return []\n",
     "has task 'translate'"),
], ids=["raises", "exits", "no-predict", "bad-task"])
def test_a_module_or_class_that_cannot_serve_names_options_entry(tmp_path: Path, code: str,
                                                                 why: str) -> None:
    path = write(tmp_path, "user_model.py", code)
    with pytest.raises(ConfigError) as err:
        options_of(python({"entry": f"{path}:X"}))
    assert err.value.param == "models[0].options.entry" and why in str(err.value), err.value


# -- options -------------------------------------------------------------------------------

def test_unknown_keys_and_setup_table_reach_setup() -> None:
    model = python({"entry": f"{PKG}.core_forms:Options", "n_estimators": 5,
                    "setup": {"alpha": 0.5, "names": ["a"]}, "deterministic": True})
    parsed = options_of(model)
    assert parsed.own == {"n_estimators": 5, "alpha": 0.5, "names": ["a"]}
    assert parsed.code.deterministic  # (options.deterministic: the kind's, not the class's)
    runner = ThreadRunner(parsed.code, parsed.own, "m")
    runner.start()
    try:
        (result,) = runner.run([{}]).results
    finally:
        runner.close()
    assert msgspec.json.decode(result["options"]) == parsed.own


def test_a_key_given_twice_is_refused() -> None:
    with pytest.raises(ConfigError) as err:
        options_of(python({"entry": f"{PKG}.core_forms:Options", "alpha": 1,
                           "setup": {"alpha": 2}}))
    assert err.value.param == "models[0].options.setup.alpha"
    assert "is given twice" in str(err.value)


@pytest.mark.parametrize(("options", "config", "key", "why"), [
    ({"workers": -1}, {}, "models[0].options.workers", "must be zero or more"),
    ({"timeout_ms": 100}, {}, "models[0].options.timeout_ms", "needs workers >= 1"),
    ({"max_rss_mb": 100}, {}, "models[0].options.max_rss_mb", "needs workers >= 1"),
    ({"inputs": [{"name": "x", "datatype": "FP33", "dims": [-1]}],
      "outputs": [{"name": "y", "datatype": "FP32", "dims": [-1]}]}, {},
     "models[0].options.inputs[0].datatype", "must be one of"),
    ({"inputs": [{"name": "x", "datatype": "FP32", "dims": [-1]}]}, {},
     "models[0].options.outputs", "must be declared too"),
    ({}, {"max_batch_size": 0}, "models[0].max_batch_size", "must be at least 1"),
], ids=["workers", "timeout", "rss", "datatype", "inputs-without-outputs", "unbatched"])
def test_the_kinds_own_options_are_checked(options: dict[str, Any], config: dict[str, Any],
                                           key: str, why: str) -> None:
    with pytest.raises(ConfigError) as err:
        options_of(python({"entry": f"{PKG}.core_forms:Echo", **options}, **config))
    assert key in str(err.value) and why in str(err.value), err.value


def load(tmp_path: Path, code: str) -> Any:
    path = write(tmp_path, "described.py", code)
    config = cfg.validate(cfg.ServerConfig(
        models=(python({"entry": f"{path}:D"}),), builtin_pipelines=False,
        cache_dir=str(CACHE_DIR)))
    return ModelRepository.load(config)


@pytest.mark.parametrize(("describe", "why"), [
    ("raise ValueError('no metadata')", "describe() failed: ValueError: no metadata"),
    ("return {'inputs': [{'name': 'x', 'datatype': 'FP32', 'shape': [-1]}]}",
     "names inputs but no outputs"),
    ("return {'inputs': [{'name': 'x', 'datatype': 'FLOAT', 'shape': [-1]}]}",
     "is no KServe datatype"),
], ids=["raises", "inputs-only", "datatype"])
def test_a_describe_that_cannot_serve_stops_start_up_naming_the_model(
        tmp_path: Path, describe: str, why: str) -> None:
    with pytest.raises(ConfigError) as err:
        load(tmp_path, f"""
            class D:
                def describe(self):
                    {describe}
                def predict(self, inputs):
                    return [{{}} for _ in inputs]
            """)
    assert "model 'm'" in str(err.value) and why in str(err.value), err.value


# -- results -------------------------------------------------------------------------------

class Record(msgspec.Struct):
    n: int


@pytest.mark.parametrize(("out", "says"), [
    ({"y": 1}, "returned a dict"),
    ((x for x in [{}]), "returned a generator"),
    ([], "returned 0 results for a batch of 1"),
    ([{}, {}], "returned 2 results for a batch of 1"),
    ([None], "result 0 is a NoneType"),
    ([[1]], "result 0 is a list"),
    ([{1: np.zeros(1)}], "named int 1"),
    ([{"y": {1}}], "'y' is a set"),
    ([{"y": object()}], "'y' is a object"),
    ([{"y": np.array([1, "a"], dtype=object)}], "object array of int"),
], ids=["dict", "generator", "none", "two", "none-result", "list-result", "int-name", "set",
        "object", "object-ints"])
def test_results_that_break_the_contract(out: Any, says: str) -> None:
    with pytest.raises(BadModelOutput) as err:
        results.check(out, 1, "m")
    assert "model 'm'" in str(err.value) and says in str(err.value), err.value


def test_results_that_keep_it() -> None:
    ok = [{"a": np.zeros(2), "b": np.float32(1), "c": "s", "d": b"b", "e": 1, "f": 1.5,
           "g": True, "h": None, "i": [1, 2], "j": {"k": 1},
           "l": np.array(["x", b"y"], dtype=object), "m": np.zeros(0, dtype=object)}]
    assert results.check(tuple(ok), 1, "m") == ok
    assert results.check([Record(1)], 1, "m", output_type=Record) == [Record(1)]
    with pytest.raises(BadModelOutput, match="not the declared Record"):
        results.check([{"n": 1}], 1, "m", output_type=Record)
    assert results.check([3, "text"], 2, "m", function=True) == [3, "text"]
    with pytest.raises(BadModelOutput, match="result 1 is a set"):
        results.check([3, {3}], 2, "m", function=True)


# -- values --------------------------------------------------------------------------------

def test_a_v2_request_becomes_arrays_and_plain_parameters() -> None:
    x = np.arange(4, dtype=np.float32).reshape(2, 2)
    request = InferRequest(
        inputs={"x": Tensor("x", "FP32", (2, 2), x),
                "s": Tensor("s", "BYTES", (2, 1), ["a", "b"]),
                "raw": Tensor("raw", "BYTES", (1,), [b"\x00\xff"])},
        parameters={"k": 3, "doc": {"a": [1]}, "priority": "batch", "timeout": 5,
                    "binary_data_output": True})
    got = values.from_request(request)
    assert list(got) == ["x", "s", "raw", "k", "doc"]  # the server's parameters stay its own
    assert got["x"] is x
    assert got["s"].dtype == object and got["s"].shape == (2, 1)
    assert got["s"].tolist() == [["a"], ["b"]] and got["raw"].tolist() == [b"\x00\xff"]
    assert (got["k"], got["doc"]) == (3, {"a": [1]})
    clash = InferRequest(inputs={"x": Tensor("x", "FP32", (1,), np.zeros(1, np.float32))},
                         parameters={"x": 1})
    with pytest.raises(InvalidInput) as err:
        values.from_request(clash)
    assert err.value.param == "parameters.x"


class Query(msgspec.Struct):
    text: str
    k: int = 1


class Outer(msgspec.Struct):
    query: Query


def test_values_are_converted_to_a_typed_input() -> None:
    assert values.typed({"text": "hi", "k": np.array(2)}, Query) == Query("hi", 2)
    with pytest.raises(InvalidInput) as err:
        values.typed({"text": "hi", "k": "many"}, Query)
    assert err.value.param == "k" and "invalid input" in str(err.value)
    with pytest.raises(InvalidInput, match="text") as err:
        values.typed({}, Query)
    assert err.value.param == "text"  # a missing field is named as the field
    with pytest.raises(InvalidInput) as err:
        values.typed({"query": {"k": 2}}, Outer)
    assert err.value.param == "query.text"
    pydantic = pytest.importorskip("pydantic")

    class Doc(pydantic.BaseModel):
        text: str
        n: int

    assert values.typed({"text": "a", "n": "3"}, Doc) == Doc(text="a", n=3)
    with pytest.raises(InvalidInput) as err:
        values.typed({"text": "a", "n": "x"}, Doc)
    assert err.value.param == "n"


def test_results_become_v2_tensors() -> None:
    result = {"f": np.ones((2, 2), np.float32), "big": np.ones(2, np.dtype(">f4")),
              "i": 7, "x": 1.5, "b": True, "s": "text", "raw": b"\x01",
              "l": [[1, 2], [3, 4]], "names": np.array(["a", "bc"]),
              "objs": np.array(["a", b"b"], dtype=object), "scalar": np.int16(3)}
    got = {t.name: t for t in values.to_tensors(result, "m")}
    assert [(n, got[n].datatype, got[n].shape) for n in result] == [
        ("f", "FP32", (2, 2)), ("big", "FP32", (2,)), ("i", "INT64", (1,)),
        ("x", "FP64", (1,)), ("b", "BOOL", (1,)), ("s", "BYTES", (1,)),
        ("raw", "BYTES", (1,)), ("l", "INT64", (2, 2)), ("names", "BYTES", (2,)),
        ("objs", "BYTES", (2,)), ("scalar", "INT16", (1,))]
    assert got["names"].data == ["a", "bc"] and got["objs"].data == ["a", b"b"]
    ordered = values.to_tensors({"b": 1, "a": 2}, "m", ("a", "b"))
    assert [t.name for t in ordered] == ["a", "b"]


@pytest.mark.parametrize(("result", "order", "says"), [
    ({"y": [[1], [1, 2]]}, (), "no regular tensor"),
    ({"y": [1, "a"]}, (), "no regular tensor"),
    ({"y": {"k": 1}}, (), "'y' is a dict"),
    ({"y": None}, (), "'y' is a NoneType"),
    ({"y": np.zeros(2, np.complex64)}, (), "complex64"),
    ({"y": np.array(["a", 3], dtype=object)}, (), "object array holding a int"),
    ({"y": np.array([2**70])}, (), "object array holding a int"),
    ({"y": 1}, ("y", "z"), "lacks output 'z'"),
    ({"y": 1, "w": 2}, ("y",), "has output 'w'"),
    ([1, 2], (), "has no named outputs"),
], ids=["ragged", "mixed", "dict", "none", "complex", "mixed-objects", "huge-int", "missing",
        "extra", "list"])
def test_results_that_are_no_tensors_are_bad_output(result: Any, order: tuple[str, ...],
                                                    says: str) -> None:
    with pytest.raises(BadModelOutput) as err:
        values.to_tensors(result, "m", order)
    assert "model 'm'" in str(err.value) and says in str(err.value), err.value


def test_plain_values_for_the_json_route() -> None:
    assert values.plain({"a": np.arange(3), "b": np.float32(1.5), "c": b"x",
                         "d": np.array([b"p", "q"], dtype=object), "e": {"k": [1]}}) == {
        "a": [0, 1, 2], "b": 1.5, "c": "x", "d": ["p", "q"], "e": {"k": [1]}}
    assert values.plain(Record(4)) == {"n": 4}


def test_the_cache_digest_tells_values_apart() -> None:
    x = np.arange(4, dtype=np.float32)

    def d(**v: Any) -> list[str]:
        return values.digest(v)

    assert d(x=x, k=1) == d(k=1, x=x.copy())  # names in any order, equal bytes
    assert d(x=x) != d(x=x.astype(np.float64))  # the dtype
    assert d(x=x) != d(x=x.reshape(2, 2))  # the shape
    assert d(x=x) != d(y=x)  # the name
    assert d(k=1) != d(k="1") and d(k=[1, 2]) != d(k=[2, 1])
    words = np.array(["ab", "c"], dtype=object)
    assert d(s=words) != d(s=np.array(["a", "bc"], dtype=object))  # lengths count
    assert values.digest(Record(1)) != values.digest(Record(2))


def test_a_function_entrys_request_must_fit_its_signature() -> None:
    def f(x: Any, scale: float = 1.0) -> Any:
        return x

    sig = inspect.signature(f)
    values.check_arguments(sig, {"x": 1}, False)
    values.check_arguments(sig, {"x": 1, "scale": 2}, False)
    with pytest.raises(InvalidInput, match="missing a required argument: 'x'"):
        values.check_arguments(sig, {"scale": 2}, False)
    with pytest.raises(InvalidInput, match="unexpected keyword argument 'y'"):
        values.check_arguments(sig, {"x": 1, "y": 2}, False)

    def g(x: Any, options: dict) -> Any:
        return x

    values.check_arguments(inspect.signature(g), {"x": 1}, True)


# -- stages --------------------------------------------------------------------------------

def test_stages_are_collected_sanitised_and_bounded() -> None:
    assert sokuji.stage is stage.stage  # (the name users write)
    with stage.collecting() as stages:
        with sokuji.stage("features"):
            pass
        with sokuji.stage('a b;dur=9,"x"\r\n'):
            pass
        with sokuji.stage("é" * 100):
            pass
        with sokuji.stage(""):
            pass
        for i in range(40):
            with sokuji.stage(f"s{i}"):
                pass
    names = [name for name, _ in stages]
    assert names[:4] == ["features", "a_b_dur_9__x___", "_" * stage.MAX_NAME, "stage"]
    assert len(stages) == stage.MAX_STAGES
    assert all(ms >= 0 for _, ms in stages)
    with sokuji.stage("outside a batch"):  # times nobody, raises nothing
        pass


def test_a_stage_that_raises_still_ends() -> None:
    with stage.collecting() as stages, pytest.raises(KeyError), sokuji.stage("failing"):
        raise KeyError("x")
    assert [n for n, _ in stages] == ["failing"]


# -- the runner ----------------------------------------------------------------------------

class Raises:
    def predict(self, inputs: list[dict]) -> list[dict]:
        raise ValueError("secret of another tenant")


class Refuses:
    def predict(self, inputs: list[dict]) -> list[dict]:
        raise InvalidInput("the model says no", param="x")


class Staged:
    def predict(self, inputs: list[dict]) -> list[dict]:
        with sokuji.stage("model"):
            return [{"n": len(inputs)} for _ in inputs]


class Steps:
    def predict(self, inputs: list[dict]) -> Any:
        yield [{"t": "a"}, None]
        yield [None, {"t": "b"}]
        yield [{"t": "c"}, None]


def code_of(cls: type) -> entry_.UserCode:
    return entry_.inspect_target(f"tests:{cls.__name__}", cls, "k")


def test_an_exception_becomes_model_code_failed_without_its_text(
        caplog: pytest.LogCaptureFixture) -> None:
    with pytest.raises(ModelCodeFailed) as err:
        invoke(code_of(Raises), Raises(), [{}], "m")
    text = str(err.value)
    assert "model 'm'" in text and "ValueError" in text and "secret" not in text
    assert err.value.status == 502 and err.value.code == "model_error"
    assert "secret of another tenant" in caplog.text  # the log has it, with its traceback
    with pytest.raises(InvalidInput, match="the model says no"):  # raised on purpose: itself
        invoke(code_of(Refuses), Refuses(), [{}], "m")


def test_the_runner_reports_the_stages_and_checks_the_results() -> None:
    ran = invoke(code_of(Staged), Staged(), [{}, {}], "m")
    assert ran.results == [{"n": 2}, {"n": 2}] and [n for n, _ in ran.stages] == ["model"]


def test_a_generators_steps_are_emitted_and_its_last_results_kept() -> None:
    emitted: list[list[Any]] = []
    ran = invoke_stream(code_of(Steps), Steps(), [{}, {}], "m", emitted.append)
    assert emitted == [[{"t": "a"}, None], [None, {"t": "b"}], [{"t": "c"}, None]]
    assert ran.results == [{"t": "c"}, {"t": "b"}]
    assert invoke(code_of(Steps), Steps(), [{}, {}], "m").results == ran.results
    with pytest.raises(BadModelOutput, match="yielded 2 results"):
        invoke_stream(code_of(Steps), Steps(), [{}], "m", emitted.append)


def test_each_instance_is_set_up_once_and_torn_down_on_close() -> None:
    log: list[str] = []

    class Counted:
        def setup(self, options: dict) -> None:
            log.append("setup")

        def predict(self, inputs: list[dict]) -> list[dict]:
            return [{} for _ in inputs]

        def teardown(self) -> None:
            log.append("teardown")

    runner = ThreadRunner(code_of(Counted), {}, "m", instances=2)
    runner.start()
    assert runner.alive and log == ["setup", "setup"]
    for _ in range(3):
        runner.run([{}])
    runner.close()
    assert not runner.alive and log == ["setup", "setup", "teardown", "teardown"]
