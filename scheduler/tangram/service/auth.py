"""Bearer tokens mapped to tenants (embedded mode's token file).

The file holds one ``TOKEN TENANT`` pair a line (``#`` starts a comment). The tenant
``system:agent`` is the node agents' identity: it may connect to the agent endpoint and
nothing else; ``system:operator`` may only trigger a configuration reload; every other
tenant may submit and see only its own trajectories. In a cluster the operator wires
ServiceAccount tokens checked with TokenReview instead.
"""

from __future__ import annotations

import hmac
import secrets
from pathlib import Path

from tangram.api.tokens import token_lines
from tangram.private_files import write_private

AGENT_TENANT = "system:agent"
OPERATOR_TENANT = "system:operator"  # may only reload the configuration


class TokenError(ValueError):
    pass


class TokenStore:
    def __init__(self, tokens: dict[str, str]) -> None:
        self._tokens = dict(tokens)

    @classmethod
    def load(cls, path: Path) -> TokenStore:
        tokens: dict[str, str] = {}
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as e:
            raise TokenError(f"{path}: {e.strerror}") from None
        for n, parts in token_lines(text):
            if len(parts) != 2 or len(parts[0]) < 16:
                raise TokenError(
                    f"{path}:{n}: expected 'TOKEN TENANT' with a token of ≥ 16 characters"
                )
            tokens[parts[0]] = parts[1]
        if not tokens:
            raise TokenError(f"{path}: no tokens")
        return cls(tokens)

    @staticmethod
    def create(path: Path, tenant: str = "local") -> TokenStore:
        """Write a new file with one client token for ``tenant`` and one agent token."""
        client, agent = secrets.token_urlsafe(24), secrets.token_urlsafe(24)
        text = f"# ARL-Tangram tokens: TOKEN TENANT\n{client} {tenant}\n{agent} {AGENT_TENANT}\n"
        # Never over one already there (FileExistsError), and whole: a crash mid-write
        # leaves no file, not one that a start would find cut short.
        write_private(path, text.encode(), exclusive=True)
        return TokenStore({client: tenant, agent: AGENT_TENANT})

    def tenant(self, token: str) -> str | None:
        given = token.encode("utf-8", "surrogateescape")  # any header bytes, no exception
        for known, tenant in self._tokens.items():
            if hmac.compare_digest(known.encode(), given):  # no timing oracle on the token
                return tenant
        return None

    def token_for(self, tenant: str) -> str | None:
        return next((t for t, who in self._tokens.items() if who == tenant), None)
