"""What every part of a custom resource's spec shares: camelCase keys, unknown keys and
infinite numbers refused, and the name patterns Kubernetes uses (pure, like the models)."""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable
from fractions import Fraction

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
# A label's name (and a qualified name's part after its prefix) and value, as the API
# server checks them: what it would refuse in a child object is refused in the spec.
_NAME_PART = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")
_DNS_SUBDOMAIN_RE = re.compile(DNS_SUBDOMAIN)
_SUFFIX = {"m": Fraction(1, 1000), "": Fraction(1), "k": Fraction(10**3), "M": Fraction(10**6),
           "G": Fraction(10**9), "T": Fraction(10**12), "P": Fraction(10**15),
           "E": Fraction(10**18), "Ki": Fraction(2**10), "Mi": Fraction(2**20),
           "Gi": Fraction(2**30), "Ti": Fraction(2**40), "Pi": Fraction(2**50),
           "Ei": Fraction(2**60)}  # fmt: skip


def quantity_value(amount: str | float) -> Fraction:
    """A Kubernetes quantity (``500m``, ``2Gi``, ``1e3``) as an exact number."""
    if not isinstance(amount, str):
        return Fraction(amount)
    found = QUANTITY.match(amount)
    if found is None:
        raise ValueError(f"{amount!r} is not a quantity")
    number, suffix = found.group(1), found.group(3) or ""
    if suffix not in _SUFFIX:  # an exponent (e3, E-2), which Fraction reads itself
        return Fraction(number + suffix)
    return Fraction(number) * _SUFFIX[suffix]


def qualified_name_problem(name: str) -> str | None:
    """Why ``name`` is not a qualified name (``[prefix/]name``, as label keys and extended
    resource names are); None when it is one."""
    prefix, _, part = name.rpartition("/")
    if "/" in name and (len(prefix) > 253 or not _DNS_SUBDOMAIN_RE.match(prefix)):
        return f"{name!r}: the part before '/' must be a DNS subdomain (example.com)"
    if len(part) > 63 or not _NAME_PART.match(part):
        return (f"{name!r}: at most 63 letters, digits, '-', '_' or '.', beginning and ending "
                "with a letter or digit")  # fmt: skip
    return None


def label_value_problem(value: str) -> str | None:
    """Why ``value`` is not a label value; None when it is one (the empty one is)."""
    if value and (len(value) > 63 or not _NAME_PART.match(value)):
        return (f"{value!r}: at most 63 letters, digits, '-', '_' or '.', beginning and "
                "ending with a letter or digit")  # fmt: skip
    return None


class Spec(BaseModel):
    """A part of a spec: camelCase keys, unknown keys rejected, finite numbers only, and
    no coercion (``true`` is no count, ``"2"`` no number): embedded mode refuses what the
    API server's schema refuses, so files that run here also apply to a cluster."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        validate_by_name=True,  # Python code may use snake_case (populate_by_name)
        validate_by_alias=True,
        extra="forbid",
        frozen=True,
        allow_inf_nan=False,
        strict=True,
    )


def unique(label: str, names: Iterable[str]) -> None:
    dup = sorted(n for n, count in Counter(names).items() if count > 1)
    if dup:
        raise ValueError(f"duplicate {label} {dup}")
