"""nereid.backends.xla.export: offline tooling that writes StableHLO/XLA bundles (never imported by the server).

* :func:`export_bundle` traces a JAX function with ``jax.export`` at each batch
  size and writes a servable bundle;
* :func:`write_bundle` is the low-level writer (IOSpecs, StableHLO modules,
  ordered weights);
* :func:`collect_provenance` records where the exporting code came from;
* :func:`bundle_arity_report`, :func:`assert_bundle_arity` and
  :func:`bundle_entry_arity` read a bundle's argument counts back out of its
  files, whoever wrote it; :func:`read_bundle_weights` reads its weights in
  program order, whichever layout they use.

jax is imported only when a function that needs it is called.
"""

from nereid.backends.xla.arity import (BundleArity, ModuleArity, assert_bundle_arity, bundle_arity_report,
                                       bundle_entry_arity)
from nereid.backends.xla.export.iospec import IOSpec
from nereid.backends.xla.export.jax_export import export_bundle
from nereid.backends.xla.export.provenance import Provenance, collect_provenance
from nereid.backends.xla.export.weights import read_bundle_weights
from nereid.backends.xla.export.writer import ExportError, write_bundle

__all__ = [
    "BundleArity", "ExportError", "IOSpec", "ModuleArity", "Provenance", "assert_bundle_arity",
    "bundle_arity_report", "bundle_entry_arity", "collect_provenance", "export_bundle", "read_bundle_weights",
    "write_bundle",
]
