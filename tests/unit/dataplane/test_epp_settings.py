"""The endpoint picker's settings it shares with the proxy (dataplane.epp.settings)."""

from __future__ import annotations

from dataplane.epp.settings import FROM_THE_PROXY, EppSettings
from dataplane.settings import ProxySettings


def test_each_shared_setting_is_the_proxys_own_and_reaches_the_proxy_parts() -> None:
    """Same flag, bounds, default and description as the proxy's; and the value given to
    the picker is what its state client, reporter and router run with."""
    for name in FROM_THE_PROXY:
        mine, proxys = EppSettings.model_fields[name], ProxySettings.model_fields[name]
        assert mine.description == proxys.description
        assert {repr(m) for m in mine.metadata} == {repr(m) for m in proxys.metadata}  # bounds
        assert mine.get_default(call_default_factory=True) == proxys.get_default(
            call_default_factory=True
        )
    settings = EppSettings(
        controlplane="cp-a:50051,cp-b:50051",
        pools="gpu",
        block_size=32,
        state_max_age_s=5.0,
        tenant_header="X-Tenant",
        log_level="DEBUG",
        epp_id="picker-1",
    )
    handed = settings.proxy_settings()
    as_given = [name for name in FROM_THE_PROXY if name != "tenant_header"]
    assert {n: getattr(handed, n) for n in as_given} == {n: getattr(settings, n) for n in as_given}
    assert handed.controlplane == ["cp-a:50051", "cp-b:50051"]
    assert handed.tenant_header == "x-tenant"  # the proxy's form of a header name
    assert handed.proxy_id == "picker-1"
