"""What every layer reads: the annotations in ``node.meta`` and the dropout seeding."""
