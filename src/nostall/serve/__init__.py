"""Serving: the generation worker's HTTP API over the model cache (``nostall serve``), a
fleet of workers on Ray Serve (``nostall fleet``) and the text-embedding service
(``nostall embed-server``).

The rooms, by role:

* configs: :mod:`~nostall.serve.config` (``WorkerConfig``, ``EmbedConfig``; the cache's
  is :mod:`nostall.cache.config`);
* the worker: :mod:`~nostall.serve.worker` (queue, thread, lifecycle),
  :mod:`~nostall.serve.jobs` (what it queues), :mod:`~nostall.serve.runner` (what a job
  does on the device), :mod:`~nostall.serve.lineup` and :mod:`~nostall.serve.schedule`
  (the order), :mod:`~nostall.serve.budget` (device memory), :mod:`~nostall.serve.calls`,
  :mod:`~nostall.serve.prompts`, :mod:`~nostall.serve.results`;
* requests: :mod:`~nostall.serve.bodies` (the bodies' shapes, pydantic),
  :mod:`~nostall.serve.requests` (what a pipeline allows), :mod:`~nostall.serve.answers`
  (the one exception → status mapping);
* HTTP: :mod:`~nostall.serve.app` and :mod:`~nostall.serve.routes` (the worker's),
  :mod:`~nostall.serve.http` (guards), :mod:`~nostall.serve.pages`,
  :mod:`~nostall.serve.metrics`, :mod:`~nostall.serve.local` (running one on loopback);
* the embedding service: :mod:`~nostall.serve.embed` (the service),
  :mod:`~nostall.serve.encoders`, :mod:`~nostall.serve.embed_cache`,
  :mod:`~nostall.serve.embed_app` (its HTTP), :mod:`~nostall.serve.client`;
* the fleet: :mod:`~nostall.serve.fleet` (the Ray Serve deployments),
  :mod:`~nostall.serve.fleet_router` (routing, no Ray), :mod:`~nostall.serve.fleet_routes`
  (its HTTP), :mod:`~nostall.serve.fleet_worker` (a worker's side),
  :mod:`~nostall.serve.routing` (the pure rules).

Import the modules directly; they need the ``serve`` extra (FastAPI, uvicorn,
prometheus-client; the fleet Ray Serve too).
"""
