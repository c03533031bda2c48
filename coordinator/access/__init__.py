"""Broker security the coordinator owns: TLS certificates, accounts, ACLs that follow the plan.

``certs`` makes the broker's CA and certificate, ``dynsec`` speaks to
Mosquitto's dynamic-security plugin, ``accounts`` decides who may use which
topic. Imports ``edge`` only.
"""
