"""Health, readiness and counters."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request

from app.asgi import JSONResponse
from app.services import Services

router = APIRouter()


def get_services(request: Request) -> Services:
    services: Services = request.app.state.services
    return services


ServicesDep = Annotated[Services, Depends(get_services)]


@router.get("/healthz")
async def healthz() -> dict[str, str]:
    """200 as soon as the server accepts requests."""
    return {"status": "ok"}


@router.get("/readyz")
async def readyz(services: ServicesDep) -> JSONResponse:
    """200 while at least one upstream answers `GET /v1/models`, else 503."""
    replicas = services.pool.replicas
    if await services.pool.probe_all():
        return JSONResponse({"status": "ready", "upstreams": {r.url: r.healthy for r in replicas}})
    message = "no upstream answers GET /v1/models: " + ", ".join(r.url for r in replicas)
    envelope = {"error": {"message": message, "type": "service_unavailable", "param": None, "code": 503}}
    return JSONResponse(envelope, status_code=503)


@router.get("/stats")
async def stats(services: ServicesDep) -> dict[str, Any]:
    """Counters since start: hits, misses, coalesced, bypassed, refreshed, errors by status."""
    return {
        "requests": dict(services.stats),
        "in_flight": len(services.flights),
        "upstreams": [{"url": r.url, "healthy": r.healthy, "in_flight": r.in_flight} for r in services.pool.replicas],
        "ranks": sorted(services.caches.opened()),
    }
