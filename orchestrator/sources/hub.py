"""Models on the Hugging Face Hub (``--model hf:...``), read on the driver:
which files, at which commit, and their header, fetched by range (a few MiB
of a model of hundreds of GB). The tensors stay where they are: each stage's
node fetches its own (orchestrator.cluster.fetching).

huggingface_hub's usual settings hold: ``HF_ENDPOINT`` (another Hub, or a
mirror), ``HF_TOKEN`` (or the token ``hf auth login`` stored), and
``HF_HUB_OFFLINE`` (then the model must be in huggingface_hub's cache, and
the driver ships it from there as it ships a local ``--model``).
"""

from __future__ import annotations

from pathlib import Path
from urllib.parse import quote

from orchestrator.config import HUB_METADATA_SECONDS
from orchestrator.sources.hub_reference import (HubReference, SourceReferenceError, choose_file, is_hub_source,
                                                parse_reference, shard_names)
from orchestrator.sources.remote_file import RemoteFile, SourceError, status_problem
from stages.gguf_file import ModelFile, read_model, read_model_files



def read_model_source(text: str) -> ModelFile:
    """The header of the model ``--model`` names: a file here, or an ``hf:``
    source (its tensors then RemoteFiles). One-line errors (ModelFileError,
    SourceReferenceError, SourceError) before anything is placed."""
    if not is_hub_source(text):
        return read_model(text)
    from huggingface_hub import constants

    reference = parse_reference(text)
    _check_repo_id(reference)
    if constants.HF_HUB_OFFLINE:
        return read_model(_cached_first_file(reference))
    return read_model_files(_remote_files(reference))


def _check_repo_id(reference: HubReference) -> None:
    """The Hub's own rules for a repo id (no "--" or "..", no ".git" at the end, ...)."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(reference.repo)
    except HFValidationError as error:
        raise SourceReferenceError(f"{reference}: not a repo id the Hub takes "
                                   f"({str(error).splitlines()[0][:120]})") from None


def _http_problem(reference: HubReference, error: Exception) -> SourceError:
    """One line for a failed question to the Hub."""
    response = getattr(error, "response", None)
    status = getattr(response, "status_code", None)
    if status is not None:
        return SourceError(f"{reference}: {status_problem(status)}")
    from huggingface_hub import constants

    return SourceError(f"{reference}: cannot reach {constants.ENDPOINT} ({type(error).__name__}: "
                       f"{str(error).splitlines()[0] if str(error) else ''}); set HF_HUB_OFFLINE=1 to use a "
                       "copy in huggingface_hub's cache")


def _remote_files(reference: HubReference) -> tuple[RemoteFile, ...]:
    """The model's files at one commit, as RemoteFiles (sizes from the Hub)."""
    import httpx2
    from huggingface_hub import HfApi, constants, get_hf_file_metadata
    from huggingface_hub.errors import HfHubHTTPError
    from huggingface_hub.utils import build_hf_headers

    endpoint = constants.ENDPOINT  # HF_ENDPOINT, read when huggingface_hub was imported

    def url(name: str, revision: str | None) -> str:  # the Hub's resolve path (as hf_hub_url makes it)
        return f"{endpoint}/{reference.repo}/resolve/{quote(revision or 'main', safe='')}/{quote(name)}"

    try:
        listing = None
        if reference.filename is None:
            info = HfApi(endpoint=endpoint).model_info(reference.repo, revision=reference.revision,
                                                       timeout=HUB_METADATA_SECONDS)
            listing = [sibling.rfilename for sibling in info.siblings or []]
        names = shard_names(choose_file(reference, listing or []))
        metadata = [get_hf_file_metadata(url(name, reference.revision), timeout=HUB_METADATA_SECONDS, endpoint=endpoint)
                    for name in names]
    except (HfHubHTTPError, httpx2.HTTPError) as error:
        raise _http_problem(reference, error) from error
    commits = {item.commit_hash for item in metadata}
    if len(commits) != 1 or None in commits:
        raise SourceError(f"{reference}: the Hub did not name one commit for the model's files "
                          f"({sorted(map(str, commits))})")
    (commit,) = commits
    for name, item in zip(names, metadata):
        if item.size is None:
            raise SourceError(f"{reference}: the Hub did not say the size of {name}")
    headers = tuple(build_hf_headers().items())
    return tuple(RemoteFile(url(name, commit), item.size, f"hf:{reference.repo}/{name}@{commit[:12]}", headers)
                 for name, item in zip(names, metadata))


def _cached_first_file(reference: HubReference) -> Path:
    """With HF_HUB_OFFLINE: the model's first file in huggingface_hub's cache
    (all its shards must be there)."""
    from huggingface_hub import hf_hub_download, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        if reference.filename is None:
            folder = Path(snapshot_download(reference.repo, revision=reference.revision, local_files_only=True))
            listing = [str(path.relative_to(folder)) for path in folder.rglob("*.gguf")]
            names = shard_names(choose_file(reference, listing))
        else:
            names = shard_names(reference.filename)
        paths = [hf_hub_download(reference.repo, name, revision=reference.revision, local_files_only=True)
                 for name in names]
    except (LocalEntryNotFoundError, FileNotFoundError):
        raise SourceError(f"{reference}: HF_HUB_OFFLINE is set and huggingface_hub's cache has no copy of it") from None
    return Path(paths[0])
