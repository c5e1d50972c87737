"""Rollout servers placed by Ray, with SGLang's router in front: for trainers that run on Ray.

    import ray
    from rollout.tools.ray_launch import launch_on_ray

    ray.init(address="auto")
    with launch_on_ray(replicas=8, serve_args=["--model", "/ckpt/policy"]) as rollout:
        rollout.url        # sglang-router's URL: send /generate and OpenAI requests here
        pusher = WeightPusher(rollout.url, admin_key=rollout.admin_key)  # reaches every replica

Each replica is one `rollout serve` (`gpus_per_replica` GPUs: its `--dp-size`) started by a Ray
actor inside a placement group: one bundle per replica, holding its GPUs, so that a replica never
spans nodes; the bundles packed onto as few nodes as will hold them. The actor serves on its
node's address, so the router (started here, on the driver) and the trainer reach it; the
weight and control routes then need an admin key, made here when not given. `shutdown()` (or
leaving the `with`) stops the router, the servers and the actors, and removes the placement group.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field

from rollout.tools.launch import launched_router, launched_server


class _ServerActor:
    """Holds one `rollout serve` process on its node (a Ray actor: see `launch_on_ray`)."""

    def __init__(self):
        self._stack = ExitStack()

    def start(self, serve_args: list[str], timeout: float) -> str:
        import ray

        host = ray.util.get_node_ip_address()
        server = self._stack.enter_context(launched_server(*serve_args, host=host, timeout=timeout))
        return server.url

    def stop(self) -> None:
        self._stack.close()


@dataclass
class RayRollout:
    url: str  # the router's
    worker_urls: list[str]
    admin_key: str
    _stack: ExitStack = field(repr=False)

    def shutdown(self) -> None:
        self._stack.close()


@contextmanager
def launch_on_ray(
    replicas: int,
    serve_args: list[str],
    *,
    gpus_per_replica: int = 1,
    cpus_per_replica: float = 1.0,
    policy: str = "cache_aware",
    admin_key: str | None = None,
    timeout: float = 900.0,
) -> Iterator[RayRollout]:
    """Place `replicas` servers with Ray (the cluster `ray.init` joined; a local one if none), start
    the router in front of them, and yield a `RayRollout`; everything stops at the end.
    `gpus_per_replica=0` places them on CPUs (tests, or CPU-only clusters)."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    if replicas < 1 or gpus_per_replica < 0:
        raise ValueError("launch_on_ray: replicas must be >= 1 and gpus_per_replica >= 0")
    if not ray.is_initialized():
        ray.init()
    admin_key = admin_key or secrets.token_hex(16)
    args = [*serve_args, "--admin-key", admin_key]
    if gpus_per_replica > 1:
        args += ["--dp-size", str(gpus_per_replica)]
    bundle = {"CPU": cpus_per_replica, **({"GPU": gpus_per_replica} if gpus_per_replica else {})}
    with ExitStack() as stack:
        pg = placement_group([dict(bundle) for _ in range(replicas)], strategy="PACK", name=f"rollout-{secrets.token_hex(4)}")
        stack.callback(remove_placement_group, pg)
        ray.get(pg.ready(), timeout=timeout)
        actor_cls = ray.remote(_ServerActor)
        actors = [
            actor_cls.options(
                num_cpus=cpus_per_replica, num_gpus=gpus_per_replica,
                scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i),
            ).remote()
            for i in range(replicas)
        ]  # fmt: skip
        for actor in actors:
            stack.callback(ray.kill, actor)
            stack.callback(lambda a=actor: ray.get(a.stop.remote(), timeout=120))
        worker_urls = ray.get([a.start.remote(args, timeout) for a in actors], timeout=timeout + 60)
        router = stack.enter_context(launched_router(worker_urls, policy))
        rollout = RayRollout(router.url, worker_urls, admin_key, stack.pop_all())
    try:
        yield rollout
    finally:
        rollout.shutdown()
