"""mini-swe-agent (``pip install 'bunshin[mini-swe-agent]'``): an environment class whose commands run in a Bunshin
workspace. See ``bunshin_async.integrations._mini_swe_agent``::

    env = BunshinEnvironment(image="my-task:latest", timeout=60)
    DefaultAgent(model, env, **agent_config).run("fix the failing test")
    env.cleanup()

or ``environment_class: bunshin_async.integrations.mini_swe_agent.BunshinEnvironment`` in a mini config.
"""

from __future__ import annotations

from .._public import publish as _publish
from ._mini_swe_agent import BunshinEnvironment, BunshinEnvironmentConfig, default_runtime

__all__ = ["BunshinEnvironment", "BunshinEnvironmentConfig", "default_runtime"]

_publish(__name__, globals())
