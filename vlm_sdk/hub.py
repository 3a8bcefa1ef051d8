"""A model named by a Hugging Face Hub id ("Qwen/Qwen2.5-VL-3B-Instruct") as a local directory.

huggingface_hub does the work, so its cache layout and its environment apply unchanged: HF_HOME /
HF_HUB_CACHE (where), HF_HUB_OFFLINE (no network: the cache only), HF_TOKEN (gated repos). An existing
local path always wins over an id of the same spelling, so a directory named like "Org/Name" is never
replaced by a download.
"""
from __future__ import annotations

import re
from pathlib import Path

from vlm_sdk.errors import InvalidRequestError, ModelNotFoundError

# "Org/Name" as the Hub spells repo ids: one slash, no "..", no leading or trailing "-" or "."; a bare
# "Name" (legacy ids) is read as a path, since a typo'd directory is the likelier meaning
_REPO_ID = re.compile(r"^(?!.*\.\.)[A-Za-z0-9_][\w.-]{0,95}/[A-Za-z0-9_][\w.-]{0,95}$")
# weights this SDK cannot read (model_loader's list) are not downloaded: a repo holding both
# safetensors and .bin files would otherwise cost twice the disk and time
IGNORE_PATTERNS = ["*.bin", "*.pt", "*.pth", "*.ckpt", "*.gguf", "*.h5", "*.msgpack", "*.onnx", "original/*"]


def is_hub_id(model: str) -> bool:
    """True when `model` is no existing path and reads as "Org/Name"."""
    return not Path(model).expanduser().exists() and bool(_REPO_ID.match(model))


def display_name(model: str) -> str:
    """The name a server reports for `model` by default: a Hub id as given (as vLLM does, so clients
    pass the id they know), else the directory's name (a snapshot's would be a commit hash)."""
    return model if is_hub_id(model) else Path(model).expanduser().resolve().name


# what `vlm-sdk plan` reads: the model's configs, not its weights
CONFIG_FILES = ["config.json", "preprocessor_config.json", "generation_config.json"]


def resolve_model(model: str, revision: str | None = None, configs_only: bool = False) -> str:
    """The local directory for `model`: the path itself when it exists, else the Hub snapshot of the
    id at `revision` (a branch, tag or commit; default main), downloaded into the hub cache unless
    it is there or HF_HUB_OFFLINE is set (`configs_only`: only its `CONFIG_FILES`). A path that does
    not exist and is no id is returned as is, for the loader to report."""
    model = str(model)
    if not is_hub_id(model):
        if revision is not None:
            raise InvalidRequestError(f"revision={revision!r} selects a version of a Hub model id ('Org/Name'); "
                                      f"{model!r} is a local path, which has no revisions: leave revision out",
                                      param="revision")
        return model
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, IncompleteSnapshotError,
                                        LocalEntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError)
    cache, offline, rev = constants.HF_HUB_CACHE, constants.HF_HUB_OFFLINE, revision or "main"
    where = f"{model!r} (revision {rev!r})"

    def fail(what: str, todo: str, cause: Exception) -> ModelNotFoundError:
        err = ModelNotFoundError(f"{model!r} is neither a local directory nor usable as a Hugging Face Hub id: "
                                 f"{what}. {todo}", model, revision, cache)
        err.__cause__ = cause
        return err

    try:
        # offline, ask the cache only: huggingface_hub would otherwise try the network first
        if configs_only:
            return snapshot_download(model, revision=revision, local_files_only=offline, allow_patterns=CONFIG_FILES)
        return snapshot_download(model, revision=revision, local_files_only=offline, ignore_patterns=IGNORE_PATTERNS)
    except GatedRepoError as e:
        raise fail(f"{where} is gated on the Hub", "Accept its terms on huggingface.co, then set HF_TOKEN or run "
                   "`hf auth login`", e) from None
    except RevisionNotFoundError as e:
        raise fail(f"the Hub has no revision {rev!r} of it", "Pass an existing branch, tag or commit as revision "
                   "(--revision)", e) from None
    except RepositoryNotFoundError as e:
        raise fail("the Hub has no such repository (or it is private)", "Check the spelling, or set HF_TOKEN for a "
                   "private one; a local checkout must be an existing directory", e) from None
    except IncompleteSnapshotError as e:  # an interrupted download: its files are partly there
        raise fail(f"its cached snapshot in {cache} is incomplete ({e})", f"Finish the download where there is "
                   f"network (`hf download {model}` with the same HF_HOME)", e) from None
    except LocalEntryNotFoundError as e:
        reason = "HF_HUB_OFFLINE is set" if offline else "the Hub could not be reached"
        raise fail(f"{where} is not in the hub cache {cache} and {reason}",
                   f"Download it where there is network (`hf download {model}` with the same HF_HOME), "
                   f"{'unset HF_HUB_OFFLINE, ' if offline else ''}or pass the checkpoint directory", e) from None
    except HfHubHTTPError as e:  # the Hub answered with an error of its own (5xx, rate limit)
        raise fail(f"the Hub answered {e}", "Retry later, or pass the checkpoint directory", e) from None
    except (OSError, ValueError) as e:  # an incomplete snapshot, an unwritable cache
        raise fail(f"{type(e).__name__}: {e}", f"Check the hub cache {cache} or pass the checkpoint directory",
                   e) from None

