"""`cdc verify`: PostgreSQL, in a snapshot whose LSN is known, against the topics read as tables
and every store (cdc.verify.run); PostgreSQL's side in cdc.verify.postgres."""
