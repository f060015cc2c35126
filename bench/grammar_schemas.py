"""The JSON schemas bench_grammar.py measures, each with one instance that validates against it
(the token walk along which masks are filled). Realistic shapes of structured-output requests:
a flat record, a nested order with an array of objects, and an event with anyOf, formats and
a nullable field; plus `json_object` (any JSON object: response_format {"type": "json_object"}).
"""

from __future__ import annotations

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string"},
        "is_member": {"type": "boolean"},
    },
    "required": ["name", "age", "email", "is_member"],
    "additionalProperties": False,
}
PERSON_INSTANCE = {"name": "Ada Lovelace", "age": 36, "email": "ada@example.com", "is_member": True}

ORDER = {
    "type": "object",
    "properties": {
        "order_id": {"type": "string", "pattern": "^ORD-[0-9]{6}$"},
        "customer": {
            "type": "object",
            "properties": {"name": {"type": "string"}, "country": {"type": "string", "enum": ["FR", "DE", "IT", "US"]}},
            "required": ["name", "country"],
            "additionalProperties": False,
        },
        "items": {
            "type": "array",
            "minItems": 1,
            "items": {
                "type": "object",
                "properties": {
                    "sku": {"type": "string"},
                    "quantity": {"type": "integer", "minimum": 1},
                    "unit_price": {"type": "number"},
                },
                "required": ["sku", "quantity", "unit_price"],
                "additionalProperties": False,
            },
        },
        "status": {"type": "string", "enum": ["pending", "paid", "shipped", "cancelled"]},
        "notes": {"type": "string"},
    },
    "required": ["order_id", "customer", "items", "status"],
    "additionalProperties": False,
}
ORDER_INSTANCE = {
    "order_id": "ORD-004217",
    "customer": {"name": "Jean Dupont", "country": "FR"},
    "items": [
        {"sku": "KB-101", "quantity": 2, "unit_price": 49.9},
        {"sku": "MS-7", "quantity": 1, "unit_price": 19.5},
        {"sku": "USB-C-2M", "quantity": 3, "unit_price": 9.99},
    ],
    "status": "paid",
    "notes": "Leave the parcel at the door.",
}

EVENT = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "minLength": 1, "maxLength": 80},
        "start": {"type": "string", "format": "date-time"},
        "duration_minutes": {"type": "integer", "minimum": 5, "maximum": 480},
        "location": {
            "anyOf": [
                {"type": "null"},
                {
                    "type": "object",
                    "properties": {"city": {"type": "string"}, "room": {"type": ["string", "null"]}},
                    "required": ["city", "room"],
                    "additionalProperties": False,
                },
            ]
        },
        "attendees": {"type": "array", "items": {"type": "string"}, "maxItems": 20},
        "priority": {"type": "string", "enum": ["low", "normal", "high"]},
    },
    "required": ["title", "start", "duration_minutes", "location", "attendees", "priority"],
    "additionalProperties": False,
}
EVENT_INSTANCE = {
    "title": "Quarterly planning",
    "start": "2026-03-14T09:30:00Z",
    "duration_minutes": 90,
    "location": {"city": "Lyon", "room": None},
    "attendees": ["alice@example.com", "bob@example.com", "chloe@example.com"],
    "priority": "high",
}

JSON_OBJECT_INSTANCE = {"answer": "Paris", "confidence": 0.97, "sources": ["atlas", "encyclopedia"], "extra": {"n": 1}}

# name -> (schema, or None for json_object; an instance that validates)
SCHEMAS: dict[str, tuple[dict | None, dict]] = {
    "person": (PERSON, PERSON_INSTANCE),
    "order": (ORDER, ORDER_INSTANCE),
    "event": (EVENT, EVENT_INSTANCE),
    "json_object": (None, JSON_OBJECT_INSTANCE),
}
