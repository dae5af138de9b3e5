"""The cluster client's own logic, in this process (no cluster, no host actor)."""

from __future__ import annotations

import pickle

import pytest

from bunshin_async import BunshinError, UnknownHost
from bunshin_async.integrations.ray import HostRef, RayCluster


def test_an_unknown_host_name_is_a_bunshin_error_naming_the_known_ones() -> None:
    cluster = RayCluster([HostRef(None, "n0", "node-0"), HostRef(None, "n1", "node-1")])
    assert cluster.host("n1").node_id == "node-1"
    with pytest.raises(UnknownHost) as info:
        cluster.host("n9")
    err = info.value
    assert isinstance(err, BunshinError) and isinstance(err, KeyError)  # `except KeyError` still catches it
    assert (err.host, err.known) == ("n9", ("n0", "n1"))
    assert str(err) == "no host 'n9' in this cluster (its hosts: n0, n1)"
    copy = pickle.loads(pickle.dumps(err))  # it crosses process boundaries with the rollout that met it
    assert type(copy) is UnknownHost and copy.fields == err.fields and str(copy) == str(err)
