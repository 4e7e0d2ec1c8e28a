"""A trajectory's files (``/v1/trajectories/{trajectory}/files``): read, write, list,
stat, make a directory, remove, rename. No core is taken and nothing is queued: the
environment's exec server does each operation as the environment's own user."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tangram.api.wire import FileEntry, FileList, FileWritten, MadeDir
from tangram.client.common import Call, TangramError

if TYPE_CHECKING:
    from tangram.client.aio import AsyncClient


class AsyncFiles:
    """Paths are absolute inside the environment, or relative to its workdir."""

    def __init__(self, client: AsyncClient, trajectory: str) -> None:
        self._client = client
        self._at = f"/v1/trajectories/{trajectory}/files"

    async def read(self, path: str) -> bytes:
        return (await self._client._call(Call("GET", self._at, params={"path": path}))).body

    async def read_text(self, path: str, encoding: str = "utf-8") -> str:
        return (await self.read(path)).decode(encoding)

    async def write(self, path: str, data: bytes | str, *, mode: int = 0o644) -> FileWritten:
        """Write the whole file (its directory must exist): it replaces ``path`` at once,
        so a reader sees the old file or the new one, never a part."""
        content = data.encode() if isinstance(data, str) else bytes(data)
        params = {"path": path, "mode": f"{mode & 0o777:03o}"}
        reply = await self._client._call(Call("PUT", self._at, params=params, content=content))
        return FileWritten.model_validate_json(reply.body)

    async def list(self, path: str = ".") -> list[FileEntry]:
        """The members of a directory (symlinks are listed, not followed)."""
        reply = await self._client._call(Call("GET", f"{self._at}/list", params={"path": path}))
        return FileList.model_validate_json(reply.body).entries

    async def stat(self, path: str) -> FileEntry:
        reply = await self._client._call(Call("GET", f"{self._at}/stat", params={"path": path}))
        return FileEntry.model_validate_json(reply.body)

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
        reply = await self._client._call(Call("POST", f"{self._at}/mkdir", {"path": path}))
        return MadeDir.model_validate_json(reply.body).created

    async def remove(self, path: str) -> None:
        """Remove a file, a symlink or a whole directory tree."""
        await self._client._call(Call("DELETE", self._at, params={"path": path}))

    async def rename(self, path: str, to: str) -> None:
        await self._client._call(Call("POST", f"{self._at}/rename", {"path": path, "to": to}))
