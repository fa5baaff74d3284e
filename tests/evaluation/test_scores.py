"""Saved zero-shot scores are reused only when whole, readable and made with the same key."""

from __future__ import annotations

import json

from ghostdistill.evaluation.scores import ScoreStore, score_key

ROW = {"scores": {"arc_easy": {"acc": 0.5, "n": 10}}, "seconds": 1.0, "limit": 10}


def test_scores_are_reused_only_when_readable_and_of_the_same_key(tmp_path):
    store = ScoreStore(tmp_path)
    key = score_key("w", "arc_easy", 10, None)
    store.put("ghost", "arc_easy", key, ROW)
    assert store.get("ghost", "arc_easy", key)["scores"] == ROW["scores"]
    assert store.get("ghost", "arc_easy", score_key("other weights", "arc_easy", 10, None)) is None

    path = store.path("ghost", "arc_easy")
    whole = path.read_text()
    path.write_text(whole[: len(whole) // 2])  # truncated
    assert store.get("ghost", "arc_easy", key) is None
    path.write_text(json.dumps({"key": key, "scores": {"arc_easy": {"accuracy": 0.5}}}))  # rows of another format
    assert store.get("ghost", "arc_easy", key) is None
    path.write_text(json.dumps({"key": key}))  # no scores at all (older format)
    assert store.get("ghost", "arc_easy", key) is None
    path.write_text("[1, 2]")  # not a record
    assert store.get("ghost", "arc_easy", key) is None
    # Rescored, it is written whole again.
    store.put("ghost", "arc_easy", key, ROW)
    assert store.get("ghost", "arc_easy", key)["scores"] == ROW["scores"]


def test_only_the_writing_rank_writes(tmp_path):
    ScoreStore(tmp_path, write=False).put("ghost", "arc_easy", "k", ROW)
    assert not any(tmp_path.iterdir())
