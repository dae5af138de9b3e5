"""A second driver (run as a subprocess by the tests): connects to the cluster, opens a workspace on host ARGV[2]
that it owns and keeps renewing, prints its id, then waits to be killed."""

import sys

import anyio
import ray

from bunshin_async.integrations.ray import RayCluster


async def main() -> None:
    async with RayCluster.connect([sys.argv[2]]) as cluster:
        ws = await cluster.workspace(cluster.hosts[0])
        await ws.exec("echo started > /workspace/started")
        print(ws.id, flush=True)
        await anyio.sleep_forever()


ray.init(address=sys.argv[1], log_to_driver=False, namespace="bunshin")
anyio.run(main)
