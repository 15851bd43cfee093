"""Per-request dependencies: the context, one SQL session, the caller."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Annotated

from fastapi import Depends, Path, Request
from sqlalchemy.ext.asyncio import AsyncSession

from controlplane.records.api.context import AdminContext

NAME_PATTERN = r"^[a-z0-9-]{1,63}$"


def get_context(request: Request) -> AdminContext:
    context: AdminContext = request.app.state.context
    return context


async def get_session(request: Request) -> AsyncIterator[AsyncSession]:
    """One session per request; whatever a service did not commit is rolled back."""
    async with get_context(request).database.sessions() as session:
        yield session


Context = Annotated[AdminContext, Depends(get_context)]
Session = Annotated[AsyncSession, Depends(get_session)]
Name = Annotated[
    str,
    Path(
        pattern=NAME_PATTERN,
        description="Lower-case letters, digits and '-', 1 to 63 characters.",
    ),
]
