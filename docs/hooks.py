"""mkdocs hooks (``hooks:`` in mkdocs.yml): fill the pages' table and value markers from the data.

``<!-- table: NAME -->`` on a line of its own becomes the table ``docs/render.py`` renders under that name
(from ``benchmarks/results/*.json``, the golden files, the notebooks' metadata or the code's presets);
``<!-- value: NAME FORMAT -->`` becomes one figure of the layout lab's validation notes. An unknown name
stops the build.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from mkdocs.exceptions import PluginError

_spec = importlib.util.spec_from_file_location("jaxpar_docs_render", Path(__file__).with_name("render.py"))
render = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(render)


def on_page_markdown(markdown: str, page, config, files) -> str:
    try:
        return render.substitute(markdown)
    except KeyError as err:
        raise PluginError(f"{page.file.src_path}: no table or value named {err} (docs/render*.py)") from None
