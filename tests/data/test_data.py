import gzip
import json

import pytest
import torch
from conftest import (
    C4_HEAD,
    C4_SAMPLE,
    WIKITEXT,
    WIKITEXT_HEAD,
    need_shared,
    tiny_model,
)

from ghostdistill.data import (
    TextSource,
    calibration_windows,
    evaluation_windows,
    generate_windows,
    load_documents,
    validate_source,
)


def test_local_formats(tmp_path, text_corpus):
    txt = tmp_path / "a.txt"
    txt.write_text("hello world")
    assert load_documents(TextSource(str(txt)), for_eval=True) == ["hello world"]
    jl = tmp_path / "b.jsonl.gz"
    with gzip.open(jl, "wt") as f:
        for i in range(5):
            f.write(json.dumps({"body": f"doc {i}"}) + "\n")
    src = TextSource(str(jl), text_field="body", first_document=1, max_documents=2)
    assert load_documents(src, for_eval=False) == ["doc 1", "doc 2"]
    js = tmp_path / "c.json"
    js.write_text(json.dumps([{"text": "x"}, {"text": "y"}]))
    assert load_documents(TextSource(str(js)), for_eval=False) == ["x", "y"]
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    pq.write_table(pa.table({"text": ["p", "q"]}), tmp_path / "d.parquet")
    assert load_documents(TextSource(str(tmp_path / "d.parquet")), for_eval=False) == ["p", "q"]
    with pytest.raises(ValueError, match="no text field 'body'"):
        load_documents(TextSource(str(js), text_field="body"), for_eval=False)


def test_bad_sources_are_named(tmp_path):
    with pytest.raises(ValueError, match="data.csv"):
        validate_source(TextSource(str(tmp_path / "data.csv")))
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        validate_source(TextSource(str(tmp_path / "nope.jsonl")))
    (tmp_path / "e.txt").write_text("x")
    with pytest.raises(ValueError, match="first_document=-1"):
        validate_source(TextSource(str(tmp_path / "e.txt"), first_document=-1))


@pytest.mark.parametrize(
    "source, for_eval, split, call, column",
    [
        ("wikitext2", True, None, (("Salesforce/wikitext", "wikitext-2-raw-v1"), {"split": "test"}), "text"),
        ("wikitext2", False, None, (("Salesforce/wikitext", "wikitext-2-raw-v1"), {"split": "train"}), "text"),
        (
            "c4",
            True,
            None,
            (
                ("allenai/c4",),
                {"data_files": {"validation": "en/c4-validation.00000-of-00008.json.gz"}, "split": "validation"},
            ),
            "text",
        ),
        (
            "c4",
            False,
            None,
            (("allenai/c4",), {"data_files": {"train": "en/c4-train.00000-of-01024.json.gz"}, "split": "train"}),
            "text",
        ),
        # A script data set: `datasets` >= 4 refuses its script, so it is read from the hub's parquet conversion.
        (
            "ptb",
            True,
            None,
            (("ptb-text-only/ptb_text_only",), {"revision": "refs/convert/parquet", "split": "test"}),
            "sentence",
        ),
        (
            "ptb",
            False,
            "validation",
            (("ptb-text-only/ptb_text_only",), {"revision": "refs/convert/parquet", "split": "validation"}),
            "sentence",
        ),
    ],
    ids=["wikitext2_eval", "wikitext2_cal", "c4_eval", "c4_cal", "ptb_eval", "ptb_validation"],
)
def test_hub_sources_load_without_a_script(monkeypatch, source, for_eval, split, call, column):
    """What each hub source asks `datasets.load_dataset` for (offline: the call is recorded, not made). None
    needs a loading script, which `datasets` >= 4 no longer runs."""
    import datasets

    calls = []

    def fake_load_dataset(*args, **kwargs):
        calls.append((args, kwargs))
        return {column: ["first row", "", "second row"]}

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    docs = load_documents(TextSource(source, split=split), for_eval=for_eval)
    assert calls == [call]
    assert "trust_remote_code" not in calls[0][1]
    if source == "ptb":
        assert docs == (["first row  second row"] if for_eval else ["first row", "", "second row"])
    elif source == "wikitext2":
        assert docs == (["first row\n\n\n\nsecond row"] if for_eval else ["first row", "second row"])


def test_a_missing_ptb_conversion_says_what_to_do(monkeypatch):
    import datasets

    def missing(*args, **kwargs):
        raise datasets.exceptions.DatasetNotFoundError("Revision 'refs/convert/parquet' doesn't exist")

    monkeypatch.setattr(datasets, "load_dataset", missing)
    with pytest.raises(FileNotFoundError, match=r"refs/convert/parquet.*local file source"):
        load_documents(TextSource("ptb"), for_eval=True)


def test_windows_are_deterministic_for_a_seed(tiny_tokenizer, text_files):
    src = TextSource(str(text_files["jsonl_gz"]))
    a = calibration_windows(tiny_tokenizer, src, 64, 10, seed=0)
    b = calibration_windows(tiny_tokenizer, src, 64, 10, seed=0)
    c = calibration_windows(tiny_tokenizer, src, 64, 10, seed=1)
    assert a.shape == (10, 64) and torch.equal(a, b) and not torch.equal(a, c)
    ev = evaluation_windows(tiny_tokenizer, TextSource(str(text_files["txt"])), 64, max_windows=5)
    assert ev.shape == (5, 64)
    with pytest.raises(ValueError, match="only 0 windows of 1000000 tokens"):
        calibration_windows(tiny_tokenizer, src, 1_000_000, 2, seed=0)


def test_generated_calibration_is_seeded_and_full_length(tiny_tokenizer):
    model = tiny_model("llama", num_layers=2)
    a = generate_windows(model, tiny_tokenizer, seq_len=12, num_samples=3, seed=0, batch_size=2, progress=False)
    b = generate_windows(model, tiny_tokenizer, seq_len=12, num_samples=3, seed=0, batch_size=2, progress=False)
    c = generate_windows(model, tiny_tokenizer, seq_len=12, num_samples=3, seed=1, batch_size=2, progress=False)
    assert a.shape == (3, 12) and torch.equal(a, b) and not torch.equal(a, c)
    assert (a[:, 0] == tiny_tokenizer.bos_token_id).all()


def test_interrupted_generated_calibration_resumes_and_equals_an_uninterrupted_run(tiny_tokenizer, tmp_path):
    """Issue 53: data-free calibration text (`source: generate`) was kept only at the end, so Ctrl-C lost it. Kept
    batch by batch with the sampler's state, a rerun samples only the batches not yet made and ends with the
    uninterrupted run's windows, to the bit; the partial file goes once the windows are kept."""
    from contextlib import nullcontext

    from ghostdistill.data.config import CalibrationData, DataConfig, EvaluationData
    from ghostdistill.data.run import RunData

    model = tiny_model("llama", num_layers=2)
    real, calls = model.generate, []

    def generate(*args, interrupt_after=None, **kwargs):
        calls.append(1)
        if interrupt_after is not None and len(calls) > interrupt_after:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    def windows(run_dir, interrupt_after=None):
        calls.clear()
        model.generate = lambda *a, **k: generate(*a, interrupt_after=interrupt_after, **k)
        cfg = DataConfig(CalibrationData(TextSource("generate"), 5, 12, 0), EvaluationData(sources=[]), batch_size=2)
        data = RunData(
            cfg, tiny_tokenizer, run_dir, dense=lambda: nullcontext(model), model_key={"m": 1}, progress=False
        )
        return data.calibration_ids()

    whole = windows(tmp_path / "whole")
    assert whole.shape == (5, 12) and len(calls) == 3  # batches of 2, 2 and 1
    with pytest.raises(KeyboardInterrupt):
        windows(tmp_path / "cut", interrupt_after=2)
    assert [p.name.endswith(".partial.pt") for p in (tmp_path / "cut").iterdir()] == [True]
    assert torch.equal(windows(tmp_path / "cut"), whole) and len(calls) == 1  # the third batch only
    assert sorted(p.name for p in (tmp_path / "cut").iterdir()) == sorted(
        p.name for p in (tmp_path / "whole").iterdir()
    )


def test_shared_data_files_load(tiny_tokenizer):
    need_shared(C4_SAMPLE, WIKITEXT)
    docs = load_documents(TextSource(str(C4_SAMPLE), first_document=1000), for_eval=True)
    assert len(docs) == 1000
    wiki = load_documents(TextSource(str(WIKITEXT), join=""), for_eval=True)
    assert wiki[0].startswith(" = Robert Boulter = ")


def test_shipped_excerpts_load(tiny_tokenizer):
    """The excerpts in data/ (the demo's evaluation text, the integration tests' calibration text)."""
    docs = load_documents(TextSource(str(C4_HEAD)), for_eval=False)
    assert len(docs) == 100 and all(len(d) > 0 for d in docs)
    wiki = load_documents(TextSource(str(WIKITEXT_HEAD), join=""), for_eval=True)
    assert len(wiki) == 1 and wiki[0].startswith(" = Robert Boulter = ") and wiki[0].endswith("\n")
    if WIKITEXT.is_file():  # an exact prefix of the full file
        assert WIKITEXT.read_text().startswith(wiki[0])


def test_shared_ngrams_finds_overlaps_across_window_boundaries():
    from ghostdistill.data import shared_ngrams

    text = torch.arange(1000)
    reference = text[:640].view(10, 64)  # the first ten evaluation windows
    windows = torch.stack([text[100:164], text[600:664], text[700:764], text[630:694]])
    # 100-163 lies inside; 600-663 straddles the end (40 tokens inside); 700-763 is outside; 630-693
    # shares only 10 tokens, fewer than the 32 of a run.
    assert shared_ngrams(windows, reference) == [0, 1]


# ---------------------------------------------------------------- bad inputs
@pytest.mark.parametrize(
    "name, content, field, match",
    [
        ("missing.txt", None, "text", r"text source file '.*missing.txt' does not exist"),
        ("empty.txt", "  \n", "text", r"empty.txt is empty \(no text\)"),
        ("empty.jsonl", "", "text", r"empty.jsonl is empty: no JSON records"),
        ("broken.jsonl", '{"text": "a"}\n{"text": \n', "text", r"broken.jsonl: line 2 is not valid JSON"),
        (
            "field.jsonl",
            '{"body": "a"}\n',
            "text",
            r"records have no text field 'text' \(they have \['body'\]\); set text_field",
        ),
        ("blank.jsonl", '{"text": ""}\n', "text", r"every record's 'text' field is empty"),
        ("notes.md", "x", "text", r"neither a hub name .* nor a file ending in"),
    ],
)
def test_bad_files_are_named(tmp_path, name, content, field, match):
    path = tmp_path / name
    if content is not None:
        path.write_text(content)
    with pytest.raises((ValueError, FileNotFoundError), match=match):
        load_documents(TextSource(str(path), text_field=field), for_eval=False)


def test_texts_shorter_than_one_window_are_named(tmp_path, tiny_tokenizer):
    path = tmp_path / "short.txt"
    path.write_text("the model layer token")
    with pytest.raises(ValueError, match=r"short: \d+ tokens is fewer than one window of seq_len=64"):
        evaluation_windows(tiny_tokenizer, TextSource(str(path)), 64)
    with pytest.raises(ValueError, match=r"short: only 0 windows of 64 tokens available, 4 requested"):
        calibration_windows(tiny_tokenizer, TextSource(str(path)), 64, 4, seed=0)


def test_generate_without_pad_bos_or_eos(tiny_tokenizer):
    """No pad token: generation still works (nothing is ever padded). No BOS and no EOS: a clear error."""
    import copy

    model = tiny_model("llama")
    tok = copy.deepcopy(tiny_tokenizer)
    tok.pad_token = None
    ids = generate_windows(model, tok, seq_len=8, num_samples=2, seed=0, progress=False)
    assert ids.shape == (2, 8) and int(ids[0, 0]) == tok.bos_token_id
    tok.bos_token = None
    tok.eos_token = None
    with pytest.raises(ValueError, match="has neither: use a text calibration source"):
        generate_windows(model, tok, seq_len=8, num_samples=2, seed=0, progress=False)


def test_disjoint_training_windows_hold_every_token_once(tiny_tokenizer, text_files):
    """Issue 51: `data.train.cut: disjoint` cuts consecutive windows of the documents joined in order (EOS
    between them), so n windows hold n x seq_len distinct positions of the text; random windows of the same
    documents overlap."""
    from ghostdistill.data import disjoint_windows

    src = TextSource(str(text_files["jsonl_gz"]))
    docs = load_documents(src, for_eval=False)
    stream = []
    for d in docs:
        stream += tiny_tokenizer(d).input_ids + [tiny_tokenizer.eos_token_id]
    n = len(stream) // 32
    ids = disjoint_windows(tiny_tokenizer, src, 32, n)
    assert ids.shape == (n, 32) and ids.flatten().tolist() == stream[: n * 32]
    with pytest.raises(ValueError, match=rf"holds {n} disjoint windows of 32 tokens, {n + 1} requested"):
        disjoint_windows(tiny_tokenizer, src, 32, n + 1)
    # Two sources: the first one's windows, then the second's, none spanning both.
    first, second = (
        TextSource(str(text_files["jsonl_gz"]), max_documents=50),
        TextSource(str(text_files["jsonl_gz"]), first_document=50),
    )
    a = disjoint_windows(tiny_tokenizer, first, 32, len(disjoint_windows_all(tiny_tokenizer, first)))
    both = disjoint_windows(tiny_tokenizer, [first, second], 32, len(a) + 3)
    assert torch.equal(both[: len(a)], a) and torch.equal(
        both[len(a) :], disjoint_windows(tiny_tokenizer, second, 32, 3)
    )


def disjoint_windows_all(tokenizer, src):
    """Every disjoint window of `src` (32 tokens)."""
    from ghostdistill.data import disjoint_windows

    with pytest.raises(ValueError, match="disjoint windows") as err:
        disjoint_windows(tokenizer, src, 32, 10**6)
    n = int(str(err.value).split("holds ")[1].split(" ")[0])
    return disjoint_windows(tokenizer, src, 32, n)


def test_generated_training_windows_top_up_the_text_and_are_kept(tiny_tokenizer, text_files, tmp_path):
    """Issue 51: `data.train.generated` adds windows the dense model writes (seeded, `generate_batch` at a
    time) after the text's windows, kept in the run folder apart from a generated source's cache: a second
    RunData reads them back without the model."""
    from contextlib import nullcontext

    from ghostdistill.data import disjoint_windows
    from ghostdistill.data.config import DataConfig, EvaluationData, TrainData
    from ghostdistill.data.run import RunData

    model = tiny_model("llama", num_layers=2)
    src = TextSource(str(text_files["jsonl_gz"]))
    train = TrainData(src, num_samples=3, seq_len=16, seed=0, cut="disjoint", generated=4, generate_batch=3)
    cfg = DataConfig(evaluation=EvaluationData(sources=[]), train=train, batch_size=2)
    cfg.validate()
    data = RunData(cfg, tiny_tokenizer, tmp_path, dense=lambda: nullcontext(model), model_key={"m": 1}, progress=False)
    ids = data.train_ids()
    assert ids.shape == (7, 16)
    assert torch.equal(ids[:3], disjoint_windows(tiny_tokenizer, src, 16, 3))
    assert (ids[3:, 0] == tiny_tokenizer.bos_token_id).all()
    expected = generate_windows(model, tiny_tokenizer, 16, 4, seed=30000, batch_size=3, progress=False)
    assert torch.equal(ids[3:], expected)
    assert [p.name.startswith("generated_train_more_") for p in tmp_path.iterdir()] == [True]
    again = RunData(cfg, tiny_tokenizer, tmp_path, dense=None, model_key={"m": 1}, progress=False)
    assert torch.equal(again.train_ids(), ids)  # read back: no model needed


@pytest.mark.parametrize(
    "train, message",
    [
        ({"cut": "shuffled"}, "data.train.cut 'shuffled': choose random (or null) or disjoint"),
        ({"cut": "disjoint", "source": None}, "disjoint cuts windows of a text source"),
        ({"generated": 0}, "data.train.generated must be a positive integer or null, got 0"),
        ({"generate_batch": 8}, "generate_batch sizes the generated windows: set data.train.generated too"),
        ({"more_sources": [TextSource("c4")]}, "more_sources are cut after data.train.source's windows"),
        ({"cut": "disjoint", "more_sources": [TextSource("generate")]}, "more_sources\\[0\\]: give a text file"),
    ],
)
def test_bad_training_cuts_are_named(text_files, train, message):
    from ghostdistill.data.config import DataConfig, EvaluationData, TrainData

    fields = {"source": TextSource(str(text_files["jsonl_gz"])), **train}
    cfg = DataConfig(evaluation=EvaluationData(sources=[]), train=TrainData(**fields))
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        cfg.validate()
