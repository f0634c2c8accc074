"""Deployment helpers, run as modules from the repository root.

``python -m deploy.local`` (``make up``) and ``python -m deploy.render_compose``. Not part of the
installed ``pd-proxy`` distribution: the manifests, dashboards and scrape configuration next to these
modules are the product; the modules only generate and start them.
"""
