"""Adapters for other trainers: ``rollq.integrations.trl`` (the ``trl`` extra). Each is
``rollq.consumers.trainer.integrations.<framework>``, named here for short."""
