"""The request path alone: admit → place → attempts → relay → outcome."""
