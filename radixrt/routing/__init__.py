"""Cache-aware request routing across replicas: pure logic, shared by `radixrt serve --dp N`
(the tokenizer process picks a scheduler) and `radixrt router` (the HTTP door picks a server)."""
