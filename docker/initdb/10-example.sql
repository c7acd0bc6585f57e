-- An example table, so that a fresh stack has something to capture (PostgreSQL's image runs
-- this once, when its data volume is empty). Replace it with your schema, or point the
-- stack at your own database (CDC_SOURCE_DSN) and drop the postgres service.
CREATE TABLE public.customers (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    name text NOT NULL,
    email text UNIQUE,
    created_at timestamptz NOT NULL DEFAULT now()
);
INSERT INTO public.customers (name, email) VALUES
    ('Ada Lovelace', 'ada@example.com'),
    ('Grace Hopper', 'grace@example.com');
