"""Hugging Face hub ids: `LLM("org/name")` resolves to a local snapshot through huggingface_hub.

    "org/name" (revision)
      | snapshot_download(allow_patterns=["config.json"])      the config alone, a few KB
      | safetensors_loader.read_safetensors_config              unsupported architecture: stop,
      v                                                          no weight downloaded
      | snapshot_download(allow_patterns=MODEL_FILES)           config, tokenizer, safetensors
      v                                                          (huggingface_hub's progress bars)
    <HF cache>/models--org--name/snapshots/<commit>/  ->  the safetensors-folder loader
                                                          (`kvjax.models.loading.registry`)

huggingface_hub owns the cache: `HF_HOME` / `HF_HUB_CACHE` say where it is, `HF_TOKEN` (or
`hf auth login`) authenticates gated and private models, `HF_HUB_OFFLINE=1` reads the cache
without a request, and with no network a cached snapshot is used as it is. huggingface_hub
reads these variables when it is imported: set them before starting Python. Its errors become one
line in kvjax's words, each naming what to do (`HubModelError`'s subclasses below).
"""

from __future__ import annotations

import glob
import os
import re
from typing import Callable

from kvjax.models.loading import safetensors_loader

#: The files a model needs: architecture, generation defaults, tokenizer, weights (single file or
#: shards with their index). Nothing else of a repository (other formats, READMEs) is fetched.
MODEL_FILES = ("config.json", "generation_config.json", "tokenizer.json",
               "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
               "*.safetensors", "model.safetensors.index.json")
CONFIG_FILES = ("config.json",)
#: huggingface_hub's `snapshot_download` signature, as far as kvjax calls it: (repo_id, *,
#: revision, allow_patterns) -> the snapshot folder. A seam for tests (a cache dir, offline, or
#: a stub raising the hub's errors).
Download = Callable[..., str]

# An `org/name` repository id as the hub spells it (letters, digits, "-", "_", "."; one slash).
_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*")


class HubModelError(OSError):
  """A hub id could not be resolved; the message says why and what to do."""


class GatedModelError(HubModelError, PermissionError):
  """The model is gated or private and this machine's token (HF_TOKEN) has no access."""


class HubModelNotFoundError(HubModelError, FileNotFoundError):
  """No such model or revision on the hub, or (offline, no network) none in the cache."""


def is_hub_id(model: str) -> bool:
  """Whether `model` reads as a hub id `org/name` and is not a local path (a local folder or
  file of that name wins)."""
  return (bool(_HUB_ID.fullmatch(model)) and not model.endswith(".gguf")
          and not os.path.exists(model))


def _default_download() -> Download:
  from huggingface_hub import snapshot_download  # noqa: PLC0415 - only hub ids import it
  return snapshot_download


def _hub_errors():
  from huggingface_hub import constants, errors  # noqa: PLC0415
  return constants, errors


def _download(repo_id: str, revision: str | None, patterns: tuple[str, ...],
              download: Download) -> str:
  """`download(repo_id, revision=, allow_patterns=)` with the hub's errors in kvjax's words."""
  constants, errors = _hub_errors()
  at = f" at revision {revision!r}" if revision else ""
  try:
    return download(repo_id, revision=revision, allow_patterns=list(patterns))
  except errors.GatedRepoError as e:
    raise GatedModelError(
        f"{repo_id} is a gated model: accept its licence on https://huggingface.co/{repo_id} "
        "and set HF_TOKEN to a token of that account") from e
  except errors.RevisionNotFoundError as e:
    raise HubModelNotFoundError(
        f"{repo_id} has no revision {revision!r} on the Hugging Face hub: pass an existing "
        "branch, tag or commit (revision= / --model_revision)") from e
  except errors.RepositoryNotFoundError as e:
    raise HubModelNotFoundError(
        f"model {repo_id!r} not found on the Hugging Face hub (nor as a local path): check the "
        "id (org/name); for a private model set HF_TOKEN") from e
  except errors.LocalEntryNotFoundError as e:  # offline or no network, and not (all) cached
    offline = "HF_HUB_OFFLINE=1" if constants.HF_HUB_OFFLINE else "no network"
    raise HubModelNotFoundError(
        f"{repo_id}{at} is not in the Hugging Face cache {constants.HF_HUB_CACHE} (or only "
        f"partly) and the hub cannot be reached ({offline}): check the id, download it once "
        "with network access (HF_HUB_OFFLINE unset), or point HF_HOME at the cache that holds "
        "it") from e
  except errors.HfHubHTTPError as e:
    status = e.response.status_code if e.response is not None else None
    if status in (401, 403):
      raise GatedModelError(
          f"the Hugging Face hub refused access to {repo_id} (HTTP {status}): the model is "
          "private or gated; set HF_TOKEN to a token with access") from e
    raise HubModelError(f"the Hugging Face hub failed to serve {repo_id}{at} (HTTP {status}): "
                        "try again later, or set HF_HUB_OFFLINE=1 to use the cache") from e


def download_config(repo_id: str, *, revision: str | None = None,
                    download: Download | None = None) -> str:
  """Fetches a hub model's config.json alone (or finds it in the cache) and checks that kvjax
  runs its architecture, before any weight is fetched.

  Args:
    repo_id: "org/name".
    revision: a branch, tag or commit; None: the default branch ("main").
    download: `Download`; None: huggingface_hub's `snapshot_download`.

  Returns:
    The snapshot folder holding config.json.

  Raises:
    GatedModelError: gated or private, no access with this token.
    HubModelNotFoundError: no such model or revision; offline with nothing cached.
    HubModelError: the hub failed otherwise.
    ValueError: an architecture or config kvjax does not run (the message names the supported
      architectures).
  """
  folder = _download(repo_id, revision, CONFIG_FILES,
                     _default_download() if download is None else download)
  try:
    safetensors_loader.read_safetensors_config(folder, f"{repo_id} (Hugging Face hub)")
  except FileNotFoundError as e:
    raise HubModelNotFoundError(f"{repo_id} has no config.json: not a transformers model "
                                "checkpoint kvjax can load") from e
  except ValueError as e:
    raise ValueError(f"{e}; nothing else was downloaded") from e
  return folder


def download_model(repo_id: str, *, revision: str | None = None,
                   download: Download | None = None) -> str:
  """Fetches what a hub model needs (`MODEL_FILES`), or finds it in the cache: first its
  config.json and the architecture check (`download_config`), then the tokenizer and the
  safetensors weights, with huggingface_hub's progress bars.

  Args:
    repo_id, revision, download: as `download_config`.

  Returns:
    The snapshot folder (config.json, tokenizer files, *.safetensors), the input of the
    safetensors-folder loader.

  Raises:
    As `download_config`; HubModelNotFoundError also when the repository has no safetensors
    weights (e.g. only PyTorch .bin files).
  """
  download = _default_download() if download is None else download
  download_config(repo_id, revision=revision, download=download)
  folder = _download(repo_id, revision, MODEL_FILES, download)
  if not glob.glob(os.path.join(folder, "*.safetensors")):
    raise HubModelNotFoundError(
        f"{repo_id} has no *.safetensors weights in {folder}: kvjax reads safetensors only "
        "(convert the checkpoint, or pick a repository that has them)")
  return folder

