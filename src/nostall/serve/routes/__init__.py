"""The worker app's routes, one :class:`fastapi.APIRouter` per resource, over the worker the
app holds (``app.state.worker``: :func:`~nostall.serve.routes.jobs.worker_of`):

* :mod:`~nostall.serve.routes.images`: ``POST /v1/images/generations``;
* :mod:`~nostall.serve.routes.videos`: ``POST /v1/videos/decode``;
* :mod:`~nostall.serve.routes.models`: ``GET /v1/models``;
* :mod:`~nostall.serve.routes.status`: ``/healthz``, ``/readyz``, ``/metrics``, ``/`` and
  ``/status.json``;
* :mod:`~nostall.serve.routes.jobs`: what the two job routes share (queueing a job and
  waiting for it while watching the client, answering a failure, the metrics).

:func:`~nostall.serve.app.create_app` puts them together.
"""
