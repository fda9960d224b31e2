"""What clients may see of the server's own text: its paths made relative, the message capped.

The log keeps absolute paths; RepositoryIndex and error messages never reveal
where the server keeps its files (ml_backends_path, nereid.yaml's folder, the
scratch folder, where nereid is installed).
"""

from __future__ import annotations

import importlib.util
import os
import re
from pathlib import Path

import nereid
from nereid.errors import PublicText, cap_message
from nereid.storage.mirror import VERSIONS_FOLDER


class ClientPaths:
    """Rewrites the server's private folders in a text meant for clients."""

    def __init__(self, ml_backends_path: Path, scratch_dir: Path, settings_source: str | Path) -> None:
        # Longest first, so that ml_backends_path wins over nereid.yaml's folder holding it.
        self._prefixes = sorted({
            (f"{ml_backends_path.resolve()}{os.sep}", ""), (f"{ml_backends_path}{os.sep}", ""),
            (f"{scratch_dir}{os.sep}", "<scratch>/"),
            (f"{Path(settings_source).resolve().parent}{os.sep}", ""),
            # And as named: settings' origins say the file so (`<folder>/prod.yaml: models[0]`), and a ConfigMap's
            # file is a link into `..data/`, elsewhere once resolved (its folder's absolute path reached clients).
            (f"{Path(os.path.abspath(settings_source)).parent}{os.sep}", ""),
            # Where nereid itself is installed (a traceback through a backend names its files).
            (f"{Path(nereid.__file__).resolve().parent}{os.sep}", "<nereid>/"),
            (f"{_backends_folder()}{os.sep}", "<nereid.backends>/"),
            # And the interpreter's own: a python model's traceback through json or numpy named the service
            # user's home and the Python build (the secrets hunt).
            *_interpreter_folders(),
        }, key=lambda pair: -len(pair[0]))
        # A version folder of a model from an object store (<root>/<m>/.nereid-versions/<id>/<m>, see
        # nereid.storage.mirror) reads as the model's folder, <m>, as a local folder's would.
        roots = sorted({f"{ml_backends_path.resolve()}{os.sep}", f"{ml_backends_path}{os.sep}"}, key=len,
                       reverse=True)
        self._versions = re.compile("(" + "|".join(map(re.escape, roots)) + r")([^/]+)/" + re.escape(VERSIONS_FOLDER)
                                    + r"/[0-9a-f]{16}(?:-[0-9a-f]{8})?/\2(?=/|$|[\s'\":,;)\]])")
        # The folders themselves, named alone ("ml_backends_path /srv/models: cannot list it", a RepositoryIndex
        # reason): the prefixes above match only what lies inside them (the secrets hunt).
        folders = {str(ml_backends_path.resolve()): "<ml_backends_path>", str(ml_backends_path): "<ml_backends_path>",
                   str(scratch_dir): "<scratch>"}
        self._folders = [(re.compile(r"(?<![\w/.~-])" + re.escape(folder) + r"(?=$|[\s'\":,;)\]])"), name)
                         for folder, name in sorted(folders.items(), key=lambda pair: -len(pair[0]))
                         if os.path.isabs(folder)]

    def public_text(self, text: str) -> str:
        """``text`` fit for clients: paths relative to ml_backends_path (or nereid.yaml's folder), capped.

        A :class:`~nereid.errors.PublicText` (what the client sent, echoed) is only capped: scrubbing it would
        rewrite the client's own names, and tell a client which absolute paths are the server's.
        """
        if isinstance(text, PublicText):
            return cap_message(text.plain())
        text = self._versions.sub(r"\1\2", text)
        for folder, name in self._folders:
            text = folder.sub(name, text)
        for prefix, replacement in self._prefixes:
            text = text.replace(prefix, replacement)
        return cap_message(text)


def _interpreter_folders() -> set[tuple[str, str]]:
    """This interpreter's standard library folders, as ``<python>/``, and its site-packages, as
    ``<site-packages>/`` (each as named and resolved)."""
    import site
    import sysconfig

    paths = sysconfig.get_paths()
    sites = {paths.get("purelib"), paths.get("platlib"), *site.getsitepackages()}
    if site.ENABLE_USER_SITE:
        sites.add(site.getusersitepackages())
    named = {(folder, "<python>/") for folder in (paths.get("stdlib"), paths.get("platstdlib"))}
    named |= {(folder, "<site-packages>/") for folder in sites}
    return {(f"{form}{os.sep}", name) for folder, name in named if folder
            for form in (folder, os.path.realpath(folder))}


def _backends_folder() -> Path:
    """Where ``nereid.backends`` is installed, found without importing it (core never imports a backend)."""
    spec = importlib.util.find_spec("nereid.backends")
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    return Path(locations[0]).resolve() if locations else Path(nereid.__file__).resolve().parent
