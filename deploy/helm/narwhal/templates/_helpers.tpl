{{- define "narwhal.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "narwhal.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "narwhal.labels" -}}
{{ include "narwhal.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "narwhal.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "narwhal.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "narwhal.discoveryNamespace" -}}
{{- default .Release.Namespace .Values.discovery.namespace -}}
{{- end -}}

{{- define "narwhal.secretName" -}}
{{- default (include "narwhal.fullname" .) .Values.credentials.existingSecret.name -}}
{{- end -}}

{{/* Which credentials the pods get: a list of [secret key, variable, config key]. */}}
{{- define "narwhal.credentials" -}}
{{- $c := .Values.credentials -}}
{{- $e := $c.existingSecret -}}
{{- $rows := list -}}
{{- if or (and $e.name $e.clientApiKeys) (and (not $e.name) $c.clientApiKeys) -}}
{{- $rows = append $rows (list "client-api-keys" "NARWHAL_API_KEYS" "server.api_keys_env") -}}
{{- end -}}
{{- if or (and $e.name $e.adminApiKeys) (and (not $e.name) $c.adminApiKeys) -}}
{{- $rows = append $rows (list "admin-api-keys" "NARWHAL_ADMIN_API_KEYS" "server.admin_api_keys_env") -}}
{{- end -}}
{{- if or (and $e.name $e.engineApiKey) (and (not $e.name) $c.engineApiKey) -}}
{{- $rows = append $rows (list "engine-api-key" "NARWHAL_ENGINE_API_KEY" "engine.api_key_env") -}}
{{- end -}}
{{- toJson $rows -}}
{{- end -}}

{{/* The router's config: the user's, with what the chart decides laid over it. */}}
{{- define "narwhal.config" -}}
{{- $config := deepCopy .Values.config -}}
{{- $server := dict "host" "0.0.0.0" "port" (int .Values.service.port) "replicas" (int .Values.replicaCount) -}}
{{- $engine := dict -}}
{{- range (include "narwhal.credentials" . | fromJsonArray) -}}
{{- $path := splitList "." (index . 2) -}}
{{- if eq (first $path) "server" -}}
{{- $_ := set $server (last $path) (index . 1) -}}
{{- else -}}
{{- $_ := set $engine (last $path) (index . 1) -}}
{{- end -}}
{{- end -}}
{{- $config = mustMergeOverwrite $config (dict "server" $server "engine" $engine) -}}
{{- if .Values.discovery.enabled -}}
{{- $found := dict "enabled" true "kind" "kubernetes" "credentials" "in_cluster" "namespace" (include "narwhal.discoveryNamespace" .) "label_selector" .Values.discovery.labelSelector -}}
{{- $_ := set $config "discovery" (mustMergeOverwrite (deepCopy .Values.discovery.settings) $found) -}}
{{- end -}}
{{- toPrettyJson $config -}}
{{- end -}}
