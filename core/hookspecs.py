"""The plugin hooks: backends claim model folders, give hints, say which files they stream from an object store,
check their defaults and read their models' options, and add their commands to the CLI."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Mapping

import pluggy

from nereid.backend import BackendClaim

PROJECT_NAME = "nereid"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


@hookspec
def nereid_claim_model(folder: Path, declared: bool) -> BackendClaim | None:
    """Claim a model folder for this backend, or decline it.

    Every registered backend is asked about every model folder; the core
    collects the claims. One claim selects the backend; none, or several, make
    the model unavailable with the candidates named, unless ``backend:`` in
    nereid.yaml names one, in which case only that backend is asked.

    :param folder: the model folder, ``<ml_backends_path>/<model name>``. Look
        only at its files: return quickly and do not load anything here.
    :param declared: True when ``backend:`` in nereid.yaml names this backend
        for the folder (only this backend is asked then). Claim the folder even
        if your files are missing, so that loading reports exactly which file
        is missing; a backend whose folders carry no signature of their own
        claims only declared folders.
    :return: a :class:`~nereid.backend.BackendClaim`, or None when the folder is
        not this backend's. The backend's name is its registration name (the
        entry-point name).

    Each backend is asked on its own; a wrapper of this hook is not a backend
    and runs around each backend's answer (a list of zero or one claim).
    """


@hookspec
def nereid_declaration_hint(folder: Path, config_name: str) -> str | None:
    """Say how to declare a folder that no backend claimed, when it looks like this backend's.

    Asked only when no backend claimed ``folder`` and nereid.yaml names no
    backend for it. A backend whose folders carry no signature of their own
    (the cxx backend's hold only a textproto) answers with a sentence such as
    "if it is a cxx model (a folder holding only model_inference.textproto may
    be one), declare it with backend: cxx and runtime: {library: PATH}"; it
    becomes part of the model's UNAVAILABLE reason.

    :param folder: the model folder; look only at its files.
    :param config_name: the configuration file, as the sentence names it (``nereid.yaml``, or the file
        ``--config`` named: ``prod.yaml``); take it or leave it out of the signature, as any hook argument.
    :return: one sentence, or None when the folder is not this backend's kind.
    """


@hookspec
def nereid_claim_signs() -> str | None:
    """Say in a few words what makes this backend claim a folder (``"main.py"``, ``"only when declared"``).

    Quoted, after the backend's name, in the reason of a folder that no
    backend claimed, so that its author learns which files to add; a backend
    that does not implement it is listed as "see its documentation".

    :return: a short phrase, or None.
    """


@hookspec
def nereid_streamed_files(name: str, declared: bool, listing: tuple[str, ...],
                          read_small: Callable[[str], bytes | None]) -> tuple[str, ...] | None:
    """Say which files of a model folder in an object store this backend reads from the store itself.

    Asked before the folder is fetched into the local mirror (``server.ml_backends_path``
    is an ``s3://``, ``gs://`` or ``az://`` URL), before any backend claims it: the
    files named stay in the store (the ``streamed`` of the folder's
    ``.nereid-remote.json``, :func:`nereid.storage.read_marker`), every other
    file is fetched to disk. Core knows no backend's file names: without an
    answer, every file is fetched. The xla backend answers a bundle's
    ``*.safetensors`` files, which it reads by ranged GETs.

    Every backend implementing it is asked on its own, unless nereid.yaml names
    a backend for the model (only that one is asked then). When several
    answer, a file stays in the store only if each of them names it (a file
    fetched is still there for a backend that would have streamed it).

    :param name: the model's name (its folder's name in the store).
    :param declared: True when ``backend:`` in nereid.yaml names this backend for
        the model (only this backend is asked then).
    :param listing: the folder's files, as paths relative to it, '/'-separated
        (``manifest.yaml``, ``sub/part.bin``).
    :param read_small: ``read_small(path)`` gives the bytes of a listed file, or
        None when it is not listed or is over 1 MiB, for a backend that decides by
        a file's content (a manifest's ``meta: true``). Read only what you need:
        each read not current in the mirror is a request to the store.
    :return: the listed files to leave in the store (a tuple of paths as
        ``listing`` gives them; names not listed are ignored), or None when the
        folder is not this backend's. An empty tuple: the backend's, streaming
        nothing.

    A hook that raises, or answers anything but a tuple (list, set) of str or
    None, is logged (once, naming the plugin) and its answer ignored: those
    files are fetched.
    """


@hookspec
def nereid_add_commands(commands: Any) -> None:
    """Add this backend's own subcommands to the ``nereid`` command line.

    Core knows no backend's tooling: the xla backend contributes ``nereid
    bundle check`` and the cxx backend ``nereid cxx-header`` through this hook.

    :param commands: the ``nereid`` parser's subcommands (what argparse's
        ``add_subparsers()`` returns). Add a parser with
        ``commands.add_parser(name, help=...)`` and give it
        ``set_defaults(run=fn)``, where ``fn(args) -> int`` runs the command
        and returns the exit code.
    """


@hookspec
def nereid_check_defaults(defaults: Mapping[str, Any], origin: str) -> None:
    """Refuse a mistake in this backend's defaults, nereid.yaml's ``backends: {<name>: {...}}``.

    Asked of this backend alone, when nereid.yaml is read (``nereid serve``,
    ``nereid check``, each edit in dynamic mode), whether or not a model of
    this backend is served: a misspelt option is found before a model that
    would use it arrives. Raise ConfigError naming ``<origin>.<key>``, as the
    model's own runtime options are refused (``RuntimeOptions`` over
    ``LayeredRuntime({}, defaults, origin)`` does that). The server logs it as
    a WARNING and serves on (the backend's own ``load()`` decides whether its
    models are refused for it, as the built-in backends' do); ``nereid check``
    fails. Optional: without it, defaults are checked only as
    each model of the backend loads.

    :param defaults: the backend's defaults, as nereid.yaml gives them.
    :param origin: where they are, for the message (``nereid.yaml: backends.python``).
    """


@hookspec
def nereid_model_options(name: str, folder: Path, runtime: Mapping[str, Any], origin: str) -> object:
    """The options a model of this backend loads with, read from ``runtime`` as its ``load()`` reads them.

    Asked when an edit of nereid.yaml changes this backend's defaults
    (``backends: {<name>: {...}}``), for each loaded model of it, twice: with
    the defaults it was loaded with under its own ``runtime:``, and with the
    new ones. A model whose two answers are equal (``==``) is not reloaded: a
    default written out (``warm_start: true``), or one the model's own
    ``runtime:`` overrides, changes nothing it runs with. Return a value that is
    equal exactly when the loads would be the same (a frozen dataclass of the
    parsed options); raise ConfigError for a mistake (the model is then
    reloaded, and its load says what is wrong). Optional: without it (or when
    it answers None), every loaded model of the backend reloads when its
    defaults change as written. Called on the server's event loop: read the
    options, and nothing more (no load, no slow file access).

    :param name: the model's name.
    :param folder: the model's folder.
    :param runtime: the model's ``runtime:`` with the backend's defaults under
        it, as ``load()`` is given it (a :class:`~nereid.runtime_options.LayeredRuntime`).
    :param origin: where the model's settings are (``nereid.yaml: models[0]``), as
        ``ModelContext.settings_origin`` says it at load.
    """
