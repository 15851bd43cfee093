"""Tenant namespaces: the tenant always wins; a client's value only subdivides it."""

from __future__ import annotations

import re

from kvcore.tenancy import cache_namespace, own_namespace, tenant_salt


def test_a_salt_is_32_hex_digits_and_differs_for_every_tenant_and_value() -> None:
    pairs = [("a", None), ("b", None), ("a", "b"), ("b", "a"), ("", "a"), ("", "a\0"),
             ("a", ""), ("a\0", None), (tenant_salt("b", None), None), ("", "b")]  # fmt: skip
    salts = [tenant_salt(tenant, own) for tenant, own in pairs]
    assert all(re.fullmatch(r"[0-9a-f]{32}", salt) for salt in salts)
    assert len(set(salts)) == len(pairs)
    assert tenant_salt("t", "\ud800") != tenant_salt("t", "\udc00")  # a lone surrogate too


def test_no_value_a_client_sends_reaches_another_tenants_namespace() -> None:
    beta = {cache_namespace({}, tenant="beta", isolating=True),
            cache_namespace({"cache_salt": "s"}, tenant="beta", isolating=False)}  # fmt: skip
    for value in ("beta", "s", *beta):
        for field in ("cache_salt", "prompt_cache_key", "extra_key"):
            for isolating in (True, False):
                got = cache_namespace({field: value}, tenant="alpha", isolating=isolating)
                assert got not in beta and got != value


def test_without_a_value_or_isolation_the_namespace_is_shared() -> None:
    assert cache_namespace({}, tenant="alpha", isolating=False) == ""
    assert cache_namespace({}, tenant=None, isolating=True) == ""
    assert cache_namespace({"prompt_cache_key": "k"}, tenant="alpha", isolating=False) == ""


def test_sglangs_extra_key_is_appended_to_the_salt_as_sglang_appends_it() -> None:
    assert own_namespace({"cache_salt": "a", "extra_key": "b"}, False) == "ab"
    assert own_namespace({"extra_key": "b"}, False) == "b"
    assert own_namespace({"cache_salt": "a", "prompt_cache_key": "k"}, True) == "a"
    assert own_namespace({"prompt_cache_key": "k"}, True) == "k"
