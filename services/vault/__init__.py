"""Secret vault: organization-scoped, sealed-box credentials injected only at run time."""
