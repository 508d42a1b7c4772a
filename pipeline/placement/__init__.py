"""Placements of a pipeline's stages beyond one host: ``ray_actor`` (a stage inside a Ray actor)
and ``ray_supervisor`` (a front end's view of those actors: find or create, watch, leave, remove).
Imported only for ``placement: ray``, so that Ray stays an optional dependency."""
