"""nereid's built-in backends; each subpackage's ``plugin`` module is a pluggy plugin."""
