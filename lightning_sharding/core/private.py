"""Files and directories only their owner can read: what the package writes on a shared node.

Training nodes are often shared (several users' jobs on one SLURM node, containers sharing
``/dev/shm``). Everything the package creates there (shared arrays and batch slots in ``/dev/shm``,
the shard cache with its partial downloads and lock files, the index cache, audit files) is created
through this module: files ``0600`` and directories ``0700``, whatever the umask. The mode is set
explicitly after creation, because the umask only takes bits away (a umask of ``0277`` would leave
a file its owner cannot write). Only what this module creates gets a mode: an existing directory a
user pointed us at keeps its own.

A cache meant to be shared between users opts in with an explicit ``mode`` (``0o660``: the group
reads and adds files): its directories get the matching bits and setgid (``0o2770``), so files added
by anyone of the group belong to the directory's group.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

FILE_MODE = 0o600
DIR_MODE = 0o700


def dir_mode(file_mode: int) -> int:
    """The directory mode that goes with ``file_mode``: whoever may read a file may enter its directory;
    a directory shared with the group is setgid, so what anyone of the group adds stays the group's."""
    mode = file_mode | stat.S_IRWXU
    for read, execute in ((stat.S_IRGRP, stat.S_IXGRP), (stat.S_IROTH, stat.S_IXOTH)):
        if mode & read:
            mode |= execute
    return mode | stat.S_ISGID if mode & stat.S_IRWXG else mode


def check_mode(mode: int | None, owner: str) -> int:
    """``mode`` (default :data:`FILE_MODE`) if it is a file mode that lets its owner read and write."""
    if mode is None:
        return FILE_MODE
    if isinstance(mode, bool) or not isinstance(mode, int) or not 0 <= mode <= 0o777 or mode & 0o600 != 0o600:
        shown = oct(mode) if isinstance(mode, int) and not isinstance(mode, bool) else repr(mode)
        raise ValueError(
            f"`{owner}={shown}` must be a file mode from 0o600 (the owner only, the default) to 0o666 that lets "
            "its owner read and write, e.g. 0o660 to share the cache with the directory's group"
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


# A query value is a credential when its name says so, or when it is long enough to be a token.
_SECRET_NAMES = ("sig", "token", "key", "secret", "pass", "cred", "auth", "session")
_SECRET_LENGTH = 16


def _secret_param(name: str, value: str) -> bool:
    return any(word in name.lower() for word in _SECRET_NAMES) or len(value) >= _SECRET_LENGTH


def redact_url(url: str) -> str:
    """``url`` with its credentials replaced by ``REDACTED``: a password in its user part
    (``https://user:pw@host``), and the query values that are credentials (a name such as ``sig``,
    ``token``, ``X-Amz-Credential``, or a value of 16 characters or more), in each part of a chained
    URL. A URL without either is returned as it is."""
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
    pairs = parse_qsl(parts.query, keep_blank_values=True)
    if netloc == parts.netloc and not any(_secret_param(k, v) for k, v in pairs):
        return url
    query = "&".join(f"{k}={REDACTED if _secret_param(k, v) else v}" for k, v in pairs)
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


def hide_credentials(urls: list[str]) -> tuple[list[str], dict[str, str]]:
    """The URLs as shown (credentials redacted), and ``{shown: real}`` for those that had any.
    Two URLs that differ only in their credentials, or a glob with credentials, are refused."""
    shown = [redact_url(u) for u in urls]
    hidden = {s: u for s, u in zip(shown, urls, strict=True) if s != u}
    if len(set(shown)) < len(shown):
        twice = next(s for s in shown if shown.count(s) > 1)
        raise ValueError(f"two data URLs differ only in their credentials ({twice}): name each file once")
    for shown_url in hidden:
        if any(c in shown_url.split("?", 1)[0].split("://", 1)[-1] for c in "*?["):
            raise ValueError(
                f"{shown_url}: a glob cannot carry credentials (each match would need its own); list the "
                "files one by one, or pass the credentials in storage_options"
            )
    return shown, hidden


def scrub(text: str, hidden: dict[str, str]) -> str:
    """``text`` with every real URL of ``hidden`` replaced by the shown one, and any other spelling of
    their credentials (a value percent-encoded another way, a URL a library printed again) redacted."""
    import re

    for shown, real in hidden.items():
        text = text.replace(real, shown)
        names, passwords = _credentials_of(real)
        for name in names:  # whatever the value's encoding, after its name
            text = re.sub(rf"({re.escape(name)}=)(?!{REDACTED})[^&\s'\"<>)]+", rf"\g<1>{REDACTED}", text)
        for secret in passwords:
            text = text.replace(secret, REDACTED)
    return text


def _credentials_of(url: str) -> tuple[list[str], list[str]]:
    """The names of ``url``'s query credentials, and the secret strings (its password, its query
    credentials' values) in their spellings."""
    from urllib.parse import parse_qsl, unquote, urlsplit

    names, passwords = [], []
    for part in url.split("::"):
        if "://" not in part:
            continue
        parts = urlsplit(part)
        user = parts.netloc.rpartition("@")[0]
        if ":" in user:
            password = user.split(":", 1)[1]
            passwords += [password, unquote(password)]
        for k, v in parse_qsl(parts.query, keep_blank_values=True):
            if _secret_param(k, v):  # parse_qsl decoded the value: its spelling in the URL too
                names.append(k)
                passwords += [v, part.split(f"{k}=", 1)[-1].split("&", 1)[0]]
    return names, sorted({p for p in passwords if len(p) >= 6}, key=len, reverse=True)
