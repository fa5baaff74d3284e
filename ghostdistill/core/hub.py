"""A model named by its Hugging Face hub id that is neither in the local cache nor reachable: one line, at once.

Left to transformers, a hub id that is not in the cache costs huggingface_hub's retries (five, with back-off:
about a minute against a refused connection, 77 s seen offline) and ends in a traceback of several chained
errors. Before anything is read, `check_hub_model` looks in the cache for the file the load reads first; when it
is not there, `HF_HUB_OFFLINE` set fails at once, and otherwise one request to the hub's endpoint, without
retries and within `HF_HUB_ETAG_TIMEOUT` seconds, tells a hub that answers (transformers then downloads as
usual) from one that cannot be reached. Both failures name the model, the cache folder and what to do.
"""

from __future__ import annotations

import urllib.error
import urllib.request


def check_hub_model(source: str, repo_id: str, revision: str | None = None, filename: str = "config.json") -> None:
    """Refuse, in one line, hub model `repo_id` (`source` as the config names it) when `filename` of it is not in
    the Hugging Face cache and the hub cannot be reached (offline by `HF_HUB_OFFLINE`, or no answer)."""
    from huggingface_hub import constants, try_to_load_from_cache

    try:
        cached = try_to_load_from_cache(repo_id, filename, revision=revision)
    except ValueError:  # not a repository id (huggingface_hub's validation): transformers names the problem
        return
    if isinstance(cached, str):
        return
    where = f"model {source!r} is not in the Hugging Face cache ({constants.HF_HUB_CACHE})"
    fetch = f"download it first where there is network (`hf download {repo_id}`)"
    if constants.HF_HUB_OFFLINE:
        raise FileNotFoundError(
            f"{where} and HF_HUB_OFFLINE=1 keeps the hub out of reach: {fetch}, point HF_HUB_CACHE at a cache "
            "that holds it, or set model.model.source to a local folder"
        )
    reason = _unreachable(constants.ENDPOINT, float(constants.HF_HUB_ETAG_TIMEOUT))
    if reason is not None:
        raise FileNotFoundError(
            f"{where} and the hub cannot be reached ({constants.ENDPOINT}: {reason}): {fetch}, or set "
            "model.model.source to a local folder; set HF_HUB_OFFLINE=1 to stop trying the hub"
        )


def _unreachable(endpoint: str, timeout: float) -> str | None:
    """Why `endpoint` does not answer one HEAD request (proxies as the environment sets them), or None when it
    answers with any HTTP status."""
    try:
        urllib.request.urlopen(urllib.request.Request(endpoint, method="HEAD"), timeout=timeout).close()
    except urllib.error.HTTPError:
        return None  # an answer: the hub is there
    except (urllib.error.URLError, OSError, ValueError) as err:
        return " ".join(str(getattr(err, "reason", err)).split()) or type(err).__name__
    return None
