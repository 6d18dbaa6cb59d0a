"""Sphinx configuration of the workbench docs site (used by `tools/build_docs.py`; `make docs`).

The site is static and offline: no request leaves the machine that serves it. MathJax 3 comes from the
`sphinx-mathjax-offline` wheel and plotly.js from the plotly package, both copied into `_static/`.
The sources are the nbdev-processed notebooks that `tools/build_docs.py` stages; they are never executed here.
"""
import shutil
from importlib import metadata
from pathlib import Path

import plotly

project = 'workbench'
author = 'workbench developers'
copyright = 'workbench developers'
try: release = version = metadata.version('workbench')
except metadata.PackageNotFoundError: release = version = ''

extensions = ['myst_nb']
exclude_patterns = ['**/.ipynb_checkpoints', '**/_*']   # names starting `_` are scratch
root_doc = 'index'

# --- notebooks: render what nbdev processed, never run anything ---
nb_execution_mode = 'off'
nb_ipywidgets_js = {}                     # the default pulls require.js and the widget manager from CDNs
nb_render_markdown_format = 'myst'        # text/markdown outputs (tables, math) as MyST, not CommonMark
nb_merge_streams = True
myst_enable_extensions = ['dollarmath', 'amsmath', 'colon_fence', 'attrs_inline']
myst_heading_anchors = 3
myst_dmath_double_inline = True
suppress_warnings = ['myst.header', 'mystnb.unknown_mime_type']

# --- offline assets: MathJax 3 (with its fonts) and plotly.js, both from installed wheels ---
_mathjax_static = Path(metadata.distribution('sphinx-mathjax-offline').locate_file('sphinx-mathjax-offline/static'))
if not (_mathjax_static/'mathjax'/'tex-chtml.js').is_file():
    raise FileNotFoundError(f"MathJax 3 is missing from {_mathjax_static}: reinstall sphinx-mathjax-offline")
PLOTLY_JS = Path(plotly.__file__).parent/'package_data'/'plotly.min.js'
if not PLOTLY_JS.is_file(): raise FileNotFoundError(f"plotly.js is missing from {PLOTLY_JS}: reinstall plotly")

html_static_path = [str(_mathjax_static)]      # holds mathjax/
mathjax_path = 'mathjax/tex-chtml.js'          # relative to _static; Sphinx 9's default is MathJax 4 from a CDN
html_js_files = [('plotly.min.js', {'priority': 200})]   # in <head>, before any inline Plotly.newPlot

# --- theme ---
html_theme = 'sphinx_book_theme'
html_title = 'workbench'
html_copy_source = False
html_show_sourcelink = False
html_last_updated_fmt = None
html_theme_options = {
    'home_page_in_toc': False,   # the home page is the first entry of "Get started"
    'show_navbar_depth': 1,
    'show_toc_level': 2,
    'use_download_button': False,
    'use_fullscreen_button': False,
    'use_repository_button': False,
    'launch_buttons': {},
    'navigation_with_keys': False,
}


def _copy_plotly(app, exc):
    "Copy plotly.min.js into the built site's `_static/` (only the one file, not the plotly package data)."
    if exc is None and app.builder.format == 'html':
        dest = Path(app.outdir)/'_static'/'plotly.min.js'
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(PLOTLY_JS, dest)


def setup(app):
    app.connect('build-finished', _copy_plotly)
