"""MkDocs hook: the reference pages generated from the code (gemps_cli.reference_docs) at each
build, so the command-line and metrics references cannot drift from what gemps does.

mkdocs.yml: `hooks: [docs/hooks/reference.py]`; the pages are reference/cli.md and
reference/metrics.md (nav entries may name them). It needs gemps importable with every extra
(a command whose extras are missing would lose its flags: the build stops instead).
"""

from __future__ import annotations

from gemps_cli import reference_docs
from mkdocs.config.defaults import MkDocsConfig
from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File, Files


def on_files(files: Files, config: MkDocsConfig) -> Files:
    for path, generate in reference_docs.iter_pages():
        if files.get_file_from_path(path) is not None:  # a written page would be silently replaced
            raise PluginError(f"{path} is generated (docs/hooks/reference.py): remove the file from docs/")
        try:
            content = generate()
        except RuntimeError as error:  # a command's extras missing here (reference_docs.command_parsers)
            raise PluginError(f"{path}: {error}") from error
        files.append(File.generated(config, path, content=content))
    return files
