"""SkyRL-gym (``pip install 'bunshin[skyrl]'``): ``BunshinTextEnv``, registered as ``bunshin-bash``, runs each
episode in a workspace and forks the members of a ``group_id`` from one set-up. See
``bunshin_async.integrations._skyrl``::

    import bunshin_async.integrations.skyrl  # registers the environment
    env = skyrl_gym.make("bunshin-bash", env_config={}, extras={"setup": [...], "group_id": "p1"})
"""

from __future__ import annotations

from ._skyrl import ENV_ID as ENV_ID
from ._skyrl import BunshinTextEnv as BunshinTextEnv
from ._skyrl import EnvRuntime as EnvRuntime
from ._skyrl import default_runtime as default_runtime
from ._skyrl import register as register

__all__ = ["ENV_ID", "BunshinTextEnv", "EnvRuntime", "default_runtime", "register"]
