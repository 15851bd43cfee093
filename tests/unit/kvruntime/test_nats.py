"""NATS URLs as log lines show them: never with the credentials they embed."""

from __future__ import annotations

import pytest

from kvruntime.nats import redacted


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("nats://127.0.0.1:4222", "nats://127.0.0.1:4222"),
        ("nats://user:s3cret@nats.svc:4222", "nats://***@nats.svc:4222"),
        ("nats://tok3n@nats.svc", "nats://***@nats.svc"),
        ("nats://a:1, tls://u:p@b:2", "nats://a:1,tls://***@b:2"),
    ],
)
def test_nats_urls_are_logged_without_credentials(url: str, shown: str) -> None:
    assert redacted(url) == shown
