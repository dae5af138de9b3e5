"""SkyRL-gym (``pip install 'bunshin[skyrl]'``): ``BunshinTextEnv``, registered as ``bunshin-bash``, runs each
episode in a workspace and forks the members of a ``group_id`` from one set-up. See
``bunshin_async.integrations._skyrl``::

    import bunshin_async.integrations.skyrl  # registers the environment
    env = skyrl_gym.make("bunshin-bash", env_config={}, extras={"setup": [...], "group_id": "p1"})
"""

from __future__ import annotations

from .._public import publish as _publish
from ._skyrl import ENV_ID, BunshinTextEnv, EnvRuntime, default_runtime, register

__all__ = ["ENV_ID", "BunshinTextEnv", "EnvRuntime", "default_runtime", "register"]

_publish(__name__, globals())
