"""Sphinx configuration for the distgrad documentation.

Build with::

    .venv/bin/sphinx-build -W --keep-going -b html docs docs/_build/html

distgrad is installed (editable) in the virtualenv, so autodoc imports it directly.
"""

project = "distgrad"
author = "the distgrad authors"
copyright = "the distgrad authors"
release = "0.1.0"
version = "0.1"

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
    "myst_parser",  # performance.md: benchmark tables are recorded in Markdown
]
source_suffix = {".rst": "restructuredtext", ".md": "markdown"}

# -- autodoc ------------------------------------------------------------------------------
autodoc_member_order = "bysource"

# -- napoleon: Google-style docstrings only ---------------------------------------------
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_include_init_with_doc = False

# -- general ------------------------------------------------------------------------------
nitpicky = False
exclude_patterns = ["_build", "Thumbs.db", ".DS_Store"]

# -- HTML ---------------------------------------------------------------------------------
html_theme = "alabaster"
html_title = "distgrad"
html_static_path = []
