"""Exported folders on tiny models of every supported family: they reload (ghostdistill's loader, plain
`from_pretrained`, remote code where ghostdistill cannot be imported) and compute what the in-memory
view computes, logits and batched left-padded greedy generation with the KV cache."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import GEMMA, TINY_FAMILIES, fit_all, tiny_model

from ghostdistill.core.plan import PruningPlan
from ghostdistill.export import export_view, load_exported
from ghostdistill.methods import RecoveryConfig

METHODS = [
    RecoveryConfig(name="ghost"),
    RecoveryConfig(name="lp", method="linearpatch", variant="diag"),
    RecoveryConfig(name="rm", method="replaceme"),
    RecoveryConfig(name="mag", method="magnitude"),
]
METHOD_OF = {
    "ghost": "ghost",
    "lp": "linearpatch",
    "rm": "replaceme",
    "mag": "magnitude",
    "pruned": None,
}


def _left_padded(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, 512, (3, 12), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :5] = 0
    mask[1, :2] = 0
    return ids.masked_fill(mask == 0, 1), mask


@pytest.fixture(scope="module", params=(*TINY_FAMILIES, GEMMA))
def fitted(request):
    torch.manual_seed(0)
    pm, _ = fit_all(tiny_model(request.param), PruningPlan.from_layers([2, 3], 6), METHODS)
    # A first-position shift large enough that treating the wrong token as first would show.
    with torch.no_grad():
        pm.operators["ghost"]["2-3"].first_shift.normal_(0, 2.0)
    return request.param, pm


@pytest.mark.parametrize("view", ["ghost", "lp", "rm", "mag", "pruned"])
@torch.no_grad()
def test_exported_view_reloads_and_matches(fitted, view, tmp_path, tiny_tokenizer):
    family, pm = fitted
    folder = export_view(pm, view, tmp_path / view, method=METHOD_OF[view], tokenizer=tiny_tokenizer)
    config = json.loads((folder / "config.json").read_text())
    with_operators = view in ("ghost", "lp")
    assert (folder / "modeling_ghostdistill.py").is_file() == with_operators
    assert ("auto_map" in config) == with_operators
    if not with_operators:
        # Folded into the weights: the plain architecture with 4 of 6 blocks, no custom code.
        from transformers import AutoModelForCausalLM

        plain = AutoModelForCausalLM.from_pretrained(folder)
        assert type(plain).__name__ == type(pm.model).__name__ and config["num_hidden_layers"] == 4
    assert config["ghostdistill"]["plan"]["removed"] == [2, 3]
    assert (folder / "tokenizer.json").is_file() and (folder / "README.md").is_file()
    reloaded = load_exported(folder)
    ids, mask = _left_padded()
    with pm.use(view) as model:
        expected = model(input_ids=ids, attention_mask=mask).logits
        expected_tokens = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
    got = reloaded(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-5)
    tokens = reloaded.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
    assert torch.equal(tokens, expected_tokens), f"{family}/{view}: greedy generation differs"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "no temporary folder is left behind"


@torch.no_grad()
def test_left_padding_applies_the_first_position_map_to_the_first_real_token(fitted):
    """generate derives positions from the mask: a left-padded row decodes as the same row alone, and
    the first-position shift matters there (zeroing it changes the tokens' logits)."""
    _, pm = fitted
    ids, mask = _left_padded()
    alone = ids[0:1, 5:]
    with pm.use("ghost") as model:
        padded = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=6,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
        single = model.generate(
            input_ids=alone,
            max_new_tokens=6,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
        assert torch.equal(padded.sequences[0, 5:], single.sequences[0])
        for a, b in zip(padded.logits, single.logits):
            torch.testing.assert_close(a[0], b[0], atol=1e-4, rtol=1e-4)
        shift = pm.operators["ghost"]["2-3"].first_shift
        saved = shift.clone()
        shift.zero_()
        unshifted = model(input_ids=alone).logits
        shift.copy_(saved)
        assert (unshifted[0, -1] - single.logits[0][0]).abs().max() > 1e-3, "the shift should matter"


def test_gap_at_the_end_loads_as_remote_code_without_ghostdistill(tmp_path, tiny_tokenizer):
    """A folder with operators loads with trust_remote_code in a process where ghostdistill cannot be
    imported (the folder's own modelling file), here with the gap at the end of the stack."""
    torch.manual_seed(0)
    pm, _ = fit_all(
        tiny_model("qwen3"),
        PruningPlan.from_layers([4, 5], 6, allow_edges=True),
        [METHODS[0]],
    )
    folder = export_view(pm, "ghost", tmp_path / "ghost", method="ghost", tokenizer=tiny_tokenizer)
    assert json.loads((folder / "config.json").read_text())["gaps"][0]["where"] == "output"
    ids, mask = _left_padded()
    torch.save({"ids": ids, "mask": mask}, tmp_path / "inputs.pt")
    code = f"""
import sys, torch
sys.modules["ghostdistill"] = None  # any import of ghostdistill now fails
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained({str(folder)!r}, trust_remote_code=True).eval()
assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
x = torch.load({str(tmp_path / "inputs.pt")!r})
with torch.no_grad():
    out = {{"logits": model(input_ids=x["ids"], attention_mask=x["mask"]).logits,
           "tokens": model.generate(input_ids=x["ids"], attention_mask=x["mask"], max_new_tokens=8, do_sample=False)}}
torch.save(out, {str(tmp_path / "out.pt")!r})
"""
    env = {
        **os.environ,
        "HF_MODULES_CACHE": str(tmp_path / "modules"),
        "PYTHONPATH": "",
    }
    done = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = torch.load(tmp_path / "out.pt")
    with torch.no_grad(), pm.use("ghost") as model:
        torch.testing.assert_close(
            out["logits"],
            model(input_ids=ids, attention_mask=mask).logits,
            atol=2e-5,
            rtol=1e-5,
        )
        assert torch.equal(
            out["tokens"],
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False),
        )


def test_existing_folders_are_replaced_only_when_asked(tmp_path):
    torch.manual_seed(0)
    pm, _ = fit_all(tiny_model("llama"), PruningPlan.from_layers([2, 3], 6), [METHODS[0]])
    folder = export_view(pm, "pruned", tmp_path / "out", method=None)
    with pytest.raises(FileExistsError, match="overwrite"):
        export_view(pm, "ghost", folder, method="ghost")
    assert not (folder / "modeling_ghostdistill.py").exists()
    export_view(pm, "ghost", folder, method="ghost", overwrite=True)
    assert (folder / "modeling_ghostdistill.py").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    with pytest.raises(ValueError, match=r"views are \['dense', 'pruned', 'ghost'\]"):
        export_view(pm, "ghost_ft", tmp_path / "x", method="ghost")


def test_model_card_states_the_plan_the_repair_and_the_numbers(tmp_path):
    torch.manual_seed(0)
    pm, _ = fit_all(tiny_model("llama"), PruningPlan.from_layers([2, 3], 6), [METHODS[0]])
    info = {
        "base_model": "tiny",
        "plan": {"num_layers": 6, "removed": [2, 3], "chosen_by": "streamline"},
        "calibration": {
            "source": {"source": "c4.jsonl", "first_document": 0, "max_documents": 10},
            "windows": 16,
            "seq_len": 64,
            "tokens": 1024,
            "seed": 0,
        },
        "seed": 0,
        "metrics": {"wiki": {"ppl": 12.3456, "kl": 0.25, "top1": 0.5, "tokens": 252}},
        "reference_metrics": {
            "dense": {"wiki": {"ppl": 10.0}},
            "pruned": {"wiki": {"ppl": 20.0}},
        },
    }
    folder = export_view(pm, "ghost", tmp_path / "g", method="ghost", info=info)
    card = (folder / "README.md").read_text()
    for text in (
        "2 of 6 blocks removed",
        "[2, 3]",
        "streamline",
        "ghost operators",
        "12.3456",
        "0.2500",
        "dense perplexity in the same run: wiki 10.00",
        "c4.jsonl, documents 0–9",
        "trust_remote_code=True",
    ):
        assert text in card, text
    assert json.loads((folder / "config.json").read_text())["ghostdistill"]["metrics"]["wiki"]["ppl"] == 12.3456


@torch.no_grad()
def test_a_view_with_its_own_blocks_exports_them(tmp_path):
    """A fine-tuned view that trains whole blocks (per-view copies) ships its copies, not the originals."""
    import copy

    from ghostdistill.core.sharded import plain_copy

    torch.manual_seed(0)
    pm, _ = fit_all(tiny_model("llama"), PruningPlan.from_layers([2, 3], 6), [METHODS[0]])
    pm.add_method("ghost_ft", {k: copy.deepcopy(op) for k, op in pm.operators["ghost"].items()})
    own = plain_copy(pm.dense_layers[4])
    for p in own.parameters():
        p.mul_(1.1)
    pm.substitute_blocks("ghost_ft", {4: own})
    ids, mask = _left_padded()
    folder = export_view(pm, "ghost_ft", tmp_path / "ft", method="ghost")
    with pm.use("ghost_ft") as model:
        expected = model(input_ids=ids, attention_mask=mask).logits
    with pm.use("ghost") as model:
        training_free = model(input_ids=ids, attention_mask=mask).logits
    got = load_exported(folder)(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-5)
    assert (got - training_free).abs().max() > 1e-3


def test_affine_operators_are_refused_not_exported_without_their_bias(tmp_path):
    pm, _ = fit_all(
        tiny_model("llama"),
        PruningPlan.from_layers([2, 3], 6),
        [RecoveryConfig(name="ghost_bias", bias=True)],
    )
    with pytest.raises(ValueError, match="affine operator"):
        export_view(pm, "ghost_bias", tmp_path / "out", method="ghost")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("umask, folder_mode, file_mode", [(0o022, 0o755, 0o644), (0o027, 0o750, 0o640)])
def test_exported_folders_get_the_permissions_of_the_umask(tmp_path, tiny_tokenizer, umask, folder_mode, file_mode):
    """As `save_pretrained` writes them (dirs 0o777, files 0o666 less the umask), not the 0o700 folder and
    0o600 files of the temporary folder it is written in: a server running as another user reads them."""
    import stat

    torch.manual_seed(0)
    pm, _ = fit_all(tiny_model("llama"), PruningPlan.from_layers([2, 3], 6), [METHODS[0]])
    previous = os.umask(umask)
    try:
        folder = export_view(pm, "ghost", tmp_path / "ghost", method="ghost", tokenizer=tiny_tokenizer)
        # Replacing an existing folder publishes the new one the same way.
        again = export_view(pm, "pruned", tmp_path / "ghost", method=None, tokenizer=tiny_tokenizer, overwrite=True)
    finally:
        os.umask(previous)
    assert again == folder
    assert stat.S_IMODE(folder.stat().st_mode) == folder_mode
    files = sorted(p for p in folder.rglob("*") if p.is_file())
    assert {"model.safetensors", "config.json", "tokenizer.json", "README.md"} <= {p.name for p in files}
    modes = {p.name: oct(stat.S_IMODE(p.stat().st_mode)) for p in files}
    assert set(modes.values()) == {oct(file_mode)}, modes
    for sub in (p for p in folder.rglob("*") if p.is_dir()):
        assert stat.S_IMODE(sub.stat().st_mode) == folder_mode, sub


def test_an_interrupted_export_leaves_nothing_and_a_rerun_cleans_orphans(tmp_path, tiny_tokenizer, monkeypatch):
    """Ctrl-C (or SIGTERM, raised as an exception) mid-write removes the temporary folder; what a SIGKILL or a
    crash left (a dead process's marked temporary folder, with or without an old folder it had moved aside) is
    cleaned by the next export of that view, and a live export's temporary folder is left alone."""
    from ghostdistill.core.lock import marked_tmpdir
    from ghostdistill.export import writer

    torch.manual_seed(0)
    pm, _ = fit_all(tiny_model("llama"), PruningPlan.from_layers([2, 3], 6), [METHODS[0]])

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(writer, "_save_weights", interrupted)
        with pytest.raises(KeyboardInterrupt):
            export_view(pm, "ghost", tmp_path / "ghost", method="ghost")
    assert list(tmp_path.iterdir()) == []

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(dead.stdout)

    def orphan(name: str, pid: int) -> Path:
        folder = marked_tmpdir(tmp_path, f".{name}.tmp-{pid}-", name)
        record = json.loads((folder / ".ghostdistill-tmp").read_text())
        (folder / ".ghostdistill-tmp").write_text(json.dumps({**record, "pid": pid}))
        (folder / "new").mkdir()
        (folder / "new" / "model.safetensors").write_bytes(b"half")
        return folder

    orphans = [orphan("ghost", dead_pid), orphan("ghost", dead_pid)]
    live = orphan("ghost", os.getppid())  # a running process's (pytest's parent): never touched
    other = orphan("pruned", dead_pid)  # another view's: its own export cleans it
    export_view(pm, "ghost", tmp_path / "ghost", method="ghost")
    assert not any(p.exists() for p in orphans)
    assert live.is_dir() and other.is_dir()
    assert (tmp_path / "ghost" / "config.json").is_file()

    # An old folder moved aside just before a crash: put back when no new folder took its place.
    shutil.rmtree(tmp_path / "ghost")
    crashed = orphan("ghost", dead_pid)
    (crashed / "old" / "inner").mkdir(parents=True)
    writer.clean_orphans(tmp_path / "ghost")
    assert (tmp_path / "ghost" / "inner").is_dir() and not crashed.exists()


def test_data_loss_export_removes_only_folders_it_can_prove_it_made(tmp_path):
    """Issue 39: a user folder named like a temporary one (`.pruned.tmp-mybackup`, `.pruned.old-123`, a
    temporary-looking folder of a dead pid without the marker) survives an export of `pruned`, and so does a
    marked folder written for another target."""
    from ghostdistill.core.lock import marked_tmpdir

    torch.manual_seed(0)
    pm, _ = fit_all(tiny_model("llama"), PruningPlan.from_layers([2, 3], 6), [METHODS[0]])
    out = tmp_path / "out"
    out.mkdir()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    mine = [out / ".pruned.tmp-mybackup", out / ".pruned.old-123", out / f".pruned.tmp-{int(dead.stdout)}-abcd"]
    for folder in mine:
        folder.mkdir()
        (folder / "precious.txt").write_text("mine")
    foreign = marked_tmpdir(out, ".pruned.tmp-9-", "ghost")  # marked, but for another target
    export_view(pm, "pruned", out / "pruned", method=None)
    export_view(pm, "pruned", out / "pruned", method=None, overwrite=True)
    for folder in mine:
        assert (folder / "precious.txt").read_text() == "mine", folder
    assert foreign.is_dir()
    assert sorted(p.name for p in out.iterdir()) == sorted([*(p.name for p in mine), foreign.name, "pruned"])


def test_data_loss_overwrite_replaces_a_link_itself_and_never_follows_it(tmp_path):
    """`overwrite` onto a target that is a symlink: the link is replaced by the new folder, the folder it pointed
    to (someone else's) is untouched, and nothing is left beside the target (no `.pruned.old-<pid>`)."""
    torch.manual_seed(0)
    pm, _ = fit_all(tiny_model("llama"), PruningPlan.from_layers([2, 3], 6), [METHODS[0]])
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "keep.txt").write_text("theirs")
    out = tmp_path / "out"
    out.mkdir()
    (out / "pruned").symlink_to(theirs)
    with pytest.raises(FileExistsError, match="exists; pass overwrite"):
        export_view(pm, "pruned", out / "pruned", method=None)
    export_view(pm, "pruned", out / "pruned", method=None, overwrite=True)
    assert not (out / "pruned").is_symlink() and (out / "pruned" / "config.json").is_file()
    assert sorted(p.name for p in theirs.iterdir()) == ["keep.txt"]
    assert [p.name for p in out.iterdir()] == ["pruned"]
    (out / "dangling").symlink_to(tmp_path / "nowhere")
    export_view(pm, "pruned", out / "dangling", method=None, overwrite=True)
    assert (out / "dangling" / "config.json").is_file()


def test_late_check_a_file_where_a_folder_goes_is_refused_even_with_overwrite(tmp_path):
    from ghostdistill.export.writer import check_target

    torch.manual_seed(0)
    pm, _ = fit_all(tiny_model("llama"), PruningPlan.from_layers([2, 3], 6), [METHODS[0]])
    (tmp_path / "pruned").write_text("a file")
    with pytest.raises(NotADirectoryError, match="is a file where a model folder goes"):
        export_view(pm, "pruned", tmp_path / "pruned", method=None, overwrite=True)
    (tmp_path / "x.F32.gguf").mkdir()
    with pytest.raises(IsADirectoryError, match=r"is a folder where a \.gguf file goes"):
        check_target(tmp_path / "x.F32.gguf", "file", overwrite=True)
    assert (tmp_path / "pruned").read_text() == "a file"


@pytest.mark.parametrize(
    "failure",
    [
        OSError(28, "No space left on device"),
        RuntimeError(
            'Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No space left on device" })'
        ),
    ],
    ids=["oserror", "safetensors"],
)
def test_disk_full_export_is_one_line_naming_the_folder_and_the_space_and_leaves_nothing(
    tmp_path, monkeypatch, failure
):
    from ghostdistill.core.io import NoSpaceError
    from ghostdistill.export import writer

    torch.manual_seed(0)
    pm, _ = fit_all(tiny_model("llama"), PruningPlan.from_layers([2, 3], 6), [METHODS[0]])

    def full(*args, **kwargs):
        raise failure

    monkeypatch.setattr(writer, "_save_weights", full)
    with pytest.raises(NoSpaceError) as err:
        export_view(pm, "ghost", tmp_path / "ghost", method="ghost")
    message = str(err.value)
    assert "\n" not in message and message.startswith(f"no space left on the disk of {tmp_path} (mounted at ")
    assert f"to write export folder {tmp_path / 'ghost'}; it needs about " in message and "free space there" in message
    assert list(tmp_path.iterdir()) == [], "the temporary folder is gone"
