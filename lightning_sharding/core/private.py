"""Files and directories only their owner can read: what the package writes on a shared node.

Training nodes are often shared (several users' jobs on one SLURM node, containers sharing
``/dev/shm``). Everything the package creates there (shared arrays and batch slots in ``/dev/shm``,
the shard cache with its partial downloads and lock files, the index cache, audit files) is created
through this module: files ``0600`` and directories ``0700``, whatever the umask. The mode is set
explicitly after creation, because the umask only takes bits away (a umask of ``0277`` would leave
a file its owner cannot write). Only what this module creates gets a mode: an existing directory a
user pointed us at keeps its own.

A cache meant to be shared between users opts in with an explicit ``mode`` (``0o660``, say): its
directories get the matching execute bits (``0o770``).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

FILE_MODE = 0o600
DIR_MODE = 0o700


def dir_mode(file_mode: int) -> int:
    """The directory mode that goes with ``file_mode``: whoever may read a file may enter its directory."""
    mode = file_mode | stat.S_IRWXU
    for read, execute in ((stat.S_IRGRP, stat.S_IXGRP), (stat.S_IROTH, stat.S_IXOTH)):
        if mode & read:
            mode |= execute
    return mode


def check_mode(mode: int | None, owner: str) -> int:
    """``mode`` (default :data:`FILE_MODE`) if it is a file mode that lets its owner read and write."""
    if mode is None:
        return FILE_MODE
    if isinstance(mode, bool) or not isinstance(mode, int) or not 0 <= mode <= 0o777 or mode & 0o600 != 0o600:
        shown = oct(mode) if isinstance(mode, int) and not isinstance(mode, bool) else repr(mode)
        raise ValueError(
            f"`{owner}={shown}` must be a file mode from 0o600 (the owner only, the default) to 0o666 that lets "
            "its owner read and write, e.g. 0o640 to share the cache with the owner's group"
        )
    return mode


def make_dirs(path: str | os.PathLike[str], mode: int = DIR_MODE) -> Path:
    """``path`` and its missing parents, each one created here given ``mode``; existing ones are left as they are."""
    path = Path(path)
    missing = []
    for parent in (path, *path.parents):
        if parent.is_dir():
            break
        missing.append(parent)
    for directory in reversed(missing):
        try:
            directory.mkdir(mode=mode)
        except FileExistsError:  # another process made it meanwhile: its mode is its creator's
            continue
        os.chmod(directory, mode)
    return path


def create_file(path: str | os.PathLike[str], flags: int = os.O_WRONLY, mode: int = FILE_MODE) -> int:
    """Create ``path`` (it must not exist) given ``mode``; an open file descriptor (``flags``)."""
    fd = os.open(path, flags | os.O_CREAT | os.O_EXCL, mode)
    try:
        os.fchmod(fd, mode)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_or_create(path: str | os.PathLike[str], flags: int = os.O_RDWR, mode: int = FILE_MODE) -> int:
    """Open ``path``, creating it given ``mode`` when missing (a lock file); an open file descriptor."""
    try:
        return create_file(path, flags, mode)
    except FileExistsError:
        return os.open(path, flags)


# -- credentials in URLs -----------------------------------------------------------------------

REDACTED = "REDACTED"
URL_CREDENTIALS = "lightning_sharding:url_credentials"
"""The key, in a reader's ``storage_options``, of ``{shown URL: real URL}``: only the storage layer
opens the real one; keys, summaries, checkpoints, audit files and messages hold the shown one."""


def redact_url(url: str) -> str:
    """``url`` with its credentials replaced by ``REDACTED``: a password in its user part
    (``https://user:pw@host``) and every query value (signed URLs, SAS and access tokens), in each
    part of a chained URL. A URL without either is returned as it is."""
    if "::" in url:
        return "::".join(redact_url(part) for part in url.split("::"))
    if "://" not in url:
        return url
    from urllib.parse import parse_qsl, urlsplit, urlunsplit

    parts = urlsplit(url)
    netloc = parts.netloc
    user, at, host = netloc.rpartition("@")
    if at and ":" in user:  # a password; a user part alone (abfss://container@account...) is no secret
        netloc = f"{user.split(':', 1)[0]}:{REDACTED}@{host}"
    query = "&".join(f"{k}={REDACTED}" for k, _ in parse_qsl(parts.query, keep_blank_values=True))
    if netloc == parts.netloc and not parts.query:
        return url
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


def hide_credentials(urls: list[str]) -> tuple[list[str], dict[str, str]]:
    """The URLs as shown (credentials redacted), and ``{shown: real}`` for those that had any."""
    shown = [redact_url(u) for u in urls]
    return shown, {s: u for s, u in zip(shown, urls, strict=True) if s != u}


def scrub(text: str, hidden: dict[str, str]) -> str:
    """``text`` with every real URL of ``hidden`` (and its secret parts) replaced by the shown one."""
    for shown, real in hidden.items():
        text = text.replace(real, shown)
        for secret in _secrets_of(real):
            text = text.replace(secret, REDACTED)
    return text


def _secrets_of(url: str) -> list[str]:
    """The secret strings inside ``url``: its password and query values (long enough to be secrets)."""
    from urllib.parse import parse_qsl, unquote, urlsplit

    found = []
    for part in url.split("::"):
        if "://" not in part:
            continue
        parts = urlsplit(part)
        if "@" in parts.netloc and ":" in parts.netloc.rsplit("@", 1)[0]:
            found.append(parts.netloc.rsplit("@", 1)[0].split(":", 1)[1])
        found += [v for _, v in parse_qsl(parts.query, keep_blank_values=True)]
    return sorted({s for v in found for s in (v, unquote(v)) if len(s) >= 6}, key=len, reverse=True)
