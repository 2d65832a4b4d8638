"""Adapters for other trainers, one module each, on the public trainer SDK alone; each
framework is an extra, imported only inside its module (``from rollq.integrations.trl
import RollqRolloutWorker``)."""
