"""Live fork, snapshot and rollback of running workspaces with CRIU: the fork layer, which works on
``WorkspaceCore`` (``bunshin_async._workspace._core``) and never on ``Workspace``. By concern: ``_dump`` (``snapshot``,
``fork``), ``_restore`` (``copies``, ``restore_into``, ``rollback``, the copies' factory ``new_core``), ``_spares``,
``_snapshot``, ``_quiesce`` (draining, one operation per workspace), ``_modes`` (memory modes, KSM) and ``_transfer``
(export and import of snapshots); the snapshot store and the layer chain are ``bunshin_async._host._snapstore``,
below the workspace core. This file only documents.

A snapshot is a CRIU dump of the workspace's whole process tree (``leave_running``: the parent carries on) plus a
copy of its overlay upper dir taken in the ``post-dump`` notification, while the tree is still frozen, so memory and
files are one moment. Both live on tmpfs (``Config.snapshot_dir``, ``BUNSHIN_SNAPDIR``, default
``/dev/shm/bunshin-snap``; the set-up mounts one with large folios there, ``prepare_snapshot_store``), so the freeze
stays short; the first restore moves the upper copy next to the workspaces, as a layer (below).

A fork is a restore of that snapshot into a new workspace: a new id, cgroup and directory, and a fresh, empty upper
dir over the snapshot's upper copy, stacked read-only as the top lower layer (copied once per snapshot, by its first
restore, to the workspaces' filesystem, so that files stat as in the parent; later restores copy nothing):
``lowerdir=<snapshot layer>:<the parent's lower chain>``, so a fork of a fork has a longer chain (``core.lower``).
Layers live outside the snapshot dir (``<workspaces dir>/.layers/<snapshot id>``), because overlayfs forbids changing
a lower layer while an overlay on it is mounted and the snapshot dir goes as soon as the snapshot is closed: each
user (the snapshot, each workspace whose chain holds the layer) has a file in ``layers/<id>.users/`` (its owner
token, for ``bunshin gc``), and the last one to let go deletes the layer. A chain deeper than ``MAX_LAYERS`` is
not stacked further: the restore copies the top layer into the new upper instead (the old way), so depth stays
bounded (overlayfs allows 500 layers and a mount's options fit in a page).

CRIU recreates the tree's own mount, pid, net, ipc and uts namespaces (they differ from CRIU's, so they are in the
images); the overlay root is handed to it as ``root`` (as runc does), mounted by a wrapper (``bunshin-init
--restore-wrap``, ``_restore._wrapper``) in a private mount namespace that exists only for the restore, so no host
mount is ever made. The wrapper first moves itself into the new cgroup; CRIU runs with
``manage_cgroups_mode=IGNORE``, so the restored tree simply inherits it. The workspace's /dev is a directory of the
agent layer, not a tmpfs, so CRIU has no tmpfs to archive (it tars each one at every dump and restore).

Who reaps the restored pid 1, and who kills it when the host dies: ``rst_sibling`` makes CRIU clone the root task
with ``CLONE_PARENT`` (cr-restore.c, ``maybe_clone_parent``), so the restored pid 1 is a child of this process, not
of CRIU. CRIU restores its ``PR_SET_PDEATHSIG(SIGKILL)`` (pie/restorer.c, ``restore_pdeath_sig``), so if the host
dies the kernel kills pid 1 and with it the whole pid namespace, as for a fresh workspace (where the shim is in
between). ``WorkspaceCore.teardown`` reaps it through its pidfd.

Memory of the copies (``ws.fork_mode``, chosen by ``Config.fork_mode``, ``BUNSHIN_FORK_MODE``, see ``_modes``). A
mode the host cannot give (no CRIU, a CRIU without the patches, no snapshot store) makes ``fork`` raise
``CapabilityMissing``, never a weaker fork; only ``auto`` ("best available") degrades, with one warning per process:

- ``"criu-cow"`` (``BUNSHIN_FORK_MODE=cow``, the default; needs criu/patches/0001-cow-restore.patch): the restore
  runs with ``CRIU_COW_RESTORE=1``, so private anonymous memory is mapped ``MAP_PRIVATE`` from the snapshot's pages
  image on tmpfs instead of being read into fresh memory: all copies of one snapshot share every page until they
  write it.
  The image must never be modified while copies live. Each such copy holds its snapshot's directory
  (``core.mem_parent``, reference-counted like the layers: ``<id>.users/``), so closing the snapshot keeps it while
  copies map it. The patch maps runs of at least 16 pages only and reads the rest: a copy that maps none of the images
  (a small workspace: a shell, the agent) lets go of the directory right after its restore, so it goes with the
  snapshot; such a copy's memory is private and its own snapshots are whole ones. Dumps run with
  ``CRIU_COW_ANON_PREFIX=<snapshot dir>/``, so such mappings are dumped as anonymous memory (forks of forks), and a dump
  of a CoW copy is incremental on the images it was restored from (criu/patches/0002, ``_dump._dump_parent``): pages it
  never wrote are referenced, not written again, so a fork of a copy costs what the copy dirtied. The new snapshot holds
  that parent directory (its ``parent`` file names it) and lets go of it when it is deleted; a chain longer than
  ``MAX_MEM_CHAIN`` is cut by a full dump, from which the copy is then restored in place (``_restore.rebase``), so
  that its later dumps are incremental on that one image (0002 can leave pages to no image but the one the copy
  maps). Differences from plain anonymous memory are listed in criu/README.md.
- ``"criu"``: stock restore, every copy reads all its pages into private memory.
- ``"criu-ksm"`` (``BUNSHIN_FORK_MODE=ksm``): stock restore through a wrapper that sets ``PR_SET_MEMORY_MERGE`` (it is
  inherited across fork and exec) before exec'ing CRIU, so the restored tasks are mergeable; KSM is switched on
  (and tuned) while this process runs, and its previous settings are put back at exit. Merging is asynchronous.
- ``"fs"`` (``BUNSHIN_FORK_MODE=fs``, and ``auto`` when CRIU is unusable, see ``_criu.criu_unavailable``): a
  filesystem-only fork, not a live one. The snapshot (``snap.mode == "fs"``) freezes the workspace's cgroup, copies
  the upper dir and records which ``Workspace.spawn`` processes still run; no CRIU call is made. A copy is a cold
  start over the snapshot's layer chain that re-runs those spawns in their order (``ws.restarted_processes``, same
  argv, cwd, env and log file; started, not waited for: a server may not listen yet when the restore returns).
  Nothing in memory is carried: restarted processes start from scratch (in-workspace pids change), shell sessions,
  open connections and processes started any other way (``exec`` with ``&``, the children of a shell) are gone,
  and pid or lock files they left stay in the files. Any restore of an fs snapshot is an fs restore, and so is a
  restore of a CRIU snapshot while ``BUNSHIN_FORK_MODE=fs`` (its upper copy and record are the same).

Network: a workspace's net namespace that is as it started (``plain_netns``: loopback only, default addresses) is
left out of the images (``--external net[...]``) and each copy gets a fresh one, made by the restore wrapper and
handed to CRIU (``inherit_fd``); sockets are carried as always. Otherwise CRIU dumps and restores the namespace.
Every workspace's and copy's net namespace has a TCP hash table of its own (16,384 buckets, native/init.c
``enter_small_hash_netns``), not the host's (262,144 here): CRIU's socket collection walks the whole table at each
dump, twice (IPv4 and IPv6).
A copy in its own user namespace (``Security.userns``, ``_userns``) cannot join a namespace the wrapper made (it is
owned by the host's user namespace), so CRIU makes it in the restored tree instead (criu/patches/0011,
``FRESH_NETNS``). CRIU dumps and restores the user namespace and its uid/gid maps, so copies keep the mapping.

Policy for calls in flight: a snapshot waits for the workspace's running tool calls to finish (new ones wait for the
snapshot), because a connection from the host cannot be dumped; the agent's listening socket can, and is restored.
"""
