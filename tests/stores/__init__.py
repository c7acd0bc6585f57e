"""Stores the product does not ship, registered the way a separate package would register its
own (the `cdc.stores` entry point group): they prove that a store joins by its folder alone."""
