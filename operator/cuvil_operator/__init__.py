"""Cuvil's Kubernetes operator: the ModelCompilation CRD and the kopf handlers behind it.

Never imports the compiler (``cuvil``): only kopf, and ``cuvil_worker.contract`` for Celery.
"""
