"""What every part of a custom resource's spec shares: camelCase keys, unknown keys and
infinite numbers refused, and the name patterns Kubernetes uses (pure, like the models)."""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable

from pydantic import BaseModel, ConfigDict
from pydantic.alias_generators import to_camel

DNS_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
POOL_REF = r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?/)?[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
ENV_NAME = r"^[A-Za-z_][A-Za-z0-9_]*$"
SECRET_KEY = r"^[-._a-zA-Z0-9]+$"
ENTRYPOINT = r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*$"
QUANTITY = re.compile(r"^[+]?(\d+(\.\d*)?|\.\d+)([eE][+-]?\d+|m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?$")
DNS_LABEL_RE = re.compile(DNS_LABEL)


class Spec(BaseModel):
    """A part of a spec: camelCase keys, unknown keys rejected, finite numbers only."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        validate_by_name=True,  # Python code may use snake_case (populate_by_name)
        validate_by_alias=True,
        extra="forbid",
        frozen=True,
        allow_inf_nan=False,
    )


def unique(label: str, names: Iterable[str]) -> None:
    dup = sorted(n for n, count in Counter(names).items() if count > 1)
    if dup:
        raise ValueError(f"duplicate {label} {dup}")
