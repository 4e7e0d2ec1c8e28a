"""A trajectory's files (``/v1/trajectories/{trajectory}/files``): read, write, list,
stat, make a directory, remove, rename, and a whole directory as a tar either way. No
core is taken and nothing is queued: the environment's exec server does each operation
as the environment's own user."""

from __future__ import annotations

import asyncio
import io
import os
import tarfile
from pathlib import Path
from typing import TYPE_CHECKING

from tangram.api.wire import FileEntry, FileList, FileWritten, MadeDir, Unpacked
from tangram.client.common import Call, TangramError, check, missing

if TYPE_CHECKING:
    from tangram.client.aio import AsyncClient


class AsyncFiles:
    """Paths are absolute inside the environment, or relative to its workdir."""

    def __init__(self, client: AsyncClient, trajectory: str) -> None:
        self._client = client
        self._trajectory = trajectory
        self._at = f"/v1/trajectories/{trajectory}/files"

    def _what(self, op: str, *paths: str) -> str:
        """The call as a timeout names it: ``files.write('a.py') of trajectory t-1``."""
        return f"files.{op}({', '.join(map(repr, paths))}) of trajectory {self._trajectory}"

    async def _get(self, op: str, path: str, under: str = "") -> bytes:
        """The body of ``GET files<under>?path=<path>``, the call named ``files.<op>``."""
        call = Call("GET", self._at + under, params={"path": path}, what=self._what(op, path))
        return (await self._client._call(call)).body

    async def read(self, path: str) -> bytes:
        return await self._get("read", path)

    async def read_text(self, path: str, encoding: str = "utf-8") -> str:
        return (await self.read(path)).decode(encoding)

    async def write(self, path: str, data: bytes | str, *, mode: int = 0o644) -> FileWritten:
        """Write the whole file (its directory must exist): it replaces ``path`` at once,
        so a reader sees the old file or the new one, never a part."""
        content = data.encode() if isinstance(data, str) else bytes(data)
        params = {"path": path, "mode": f"{_mode(mode):03o}"}
        what = self._what("write", path)
        call = Call("PUT", self._at, params=params, content=content, what=what)
        reply = await self._client._call(call)
        return FileWritten.model_validate_json(reply.body)

    async def list(self, path: str = ".") -> list[FileEntry]:
        """The members of a directory (symlinks are listed, not followed)."""
        return FileList.model_validate_json(await self._get("list", path, "/list")).entries

    async def stat(self, path: str) -> FileEntry:
        return FileEntry.model_validate_json(await self._get("stat", path, "/stat"))

    async def exists(self, path: str) -> bool:
        try:
            await self.stat(path)
        except TangramError as e:
            if e.status == 404:
                return False
            raise
        return True

    async def make_dir(self, path: str) -> bool:
        """Make the directory and its parents; False if it was one already."""
        what = self._what("make_dir", path)
        reply = await self._client._call(
            Call("POST", f"{self._at}/mkdir", {"path": path}, what=what)
        )
        return MadeDir.model_validate_json(reply.body).created

    async def remove(self, path: str) -> None:
        """Remove a file, a symlink or a whole directory tree."""
        reply, resent = await self._client._exchange(
            Call("DELETE", self._at, params={"path": path}, what=self._what("remove", path))
        )
        if resent and missing(reply, "path"):
            return  # sent again after a lost answer: the first try removed it
        check(reply)

    async def rename(self, path: str, to: str) -> None:
        what = self._what("rename", path, to)
        call = Call("POST", f"{self._at}/rename", {"path": path, "to": to}, what=what)
        reply, resent = await self._client._exchange(call)
        if resent and missing(reply, "path") and await self._moved(path, to):
            return  # sent again after a lost answer: the first try moved it
        check(reply)

    async def _moved(self, path: str, to: str) -> bool:
        return await self.exists(to) and not await self.exists(path)

    async def write_tar(self, path: str, data: bytes) -> Unpacked:
        """Extract a tar, or a gzipped one, into the directory ``path`` (made if missing),
        merging with what is there. Members that would land outside it are refused."""
        kind = "application/gzip" if data[:2] == b"\x1f\x8b" else "application/x-tar"
        call = Call(
            "PUT", f"{self._at}/tar", params={"path": path}, content=bytes(data),
            headers={"Content-Type": kind}, what=self._what("write_tar", path),
        )  # fmt: skip
        return Unpacked.model_validate_json((await self._client._call(call)).body)

    async def read_tar(self, path: str) -> bytes:
        """The directory ``path`` as a tar, its members named relative to it."""
        return await self._get("read_tar", path, "/tar")

    async def upload_dir(
        self, local: str | os.PathLike[str], path: str, *, compress: bool = True
    ) -> Unpacked:
        """Copy the local directory ``local`` into ``path`` in the environment, as one
        tar (gzipped unless ``compress`` is false: less to send, and the pool's upload
        limit counts the bytes sent)."""
        return await self.write_tar(path, await asyncio.to_thread(pack, Path(local), compress))

    async def download_dir(self, path: str, local: str | os.PathLike[str]) -> Path:
        """Copy the directory ``path`` of the environment into the local directory
        ``local`` (made if missing); its path."""
        data = await self.read_tar(path)
        return await asyncio.to_thread(unpack, data, Path(local))


def _mode(mode: int) -> int:
    """``mode`` as the files API takes it, or why not: masking it wrote 0o4755 as 0o755
    and 0o10000 as 0 without a word (the API itself refuses them with 400)."""
    if isinstance(mode, bool) or not isinstance(mode, int):
        raise TypeError(f"mode: an int such as 0o644, not {type(mode).__name__}")
    if not 0 <= mode <= 0o777:
        raise ValueError(
            f"mode: {oct(mode) if mode >= 0 else mode} is not permission bits from 0o000 to "
            "0o777 (the files API sets no setuid, setgid or sticky bit, nor a file type)"
        )
    return mode


def pack(local: Path, compress: bool) -> bytes:
    """The directory ``local`` as a tar of its members (not of itself)."""
    if not local.is_dir():
        raise NotADirectoryError(f"{local}: not a directory")
    out = io.BytesIO()
    # Gzip level 1 as it is written: fast, and most of what gzip gains on source trees.
    with (
        tarfile.open(fileobj=out, mode="w:gz", compresslevel=1)
        if compress
        else tarfile.open(fileobj=out, mode="w")
    ) as tar:
        for member in sorted(local.iterdir()):
            tar.add(member, arcname=member.name)
    return out.getvalue()


def unpack(data: bytes, local: Path) -> Path:
    """Extract the tar ``data`` into ``local``. The "tar" filter refuses members that
    would land outside it (through '..', an absolute name or a symlink) but keeps the
    environment's symlinks as they are, absolute ones too (the "data" filter would
    refuse the whole tar for one of those)."""
    local.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tar:
        tar.extractall(local, filter="tar")
    return local
